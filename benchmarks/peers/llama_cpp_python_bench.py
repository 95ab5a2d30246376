"""llama-cpp-python peer: ``Llama.generate`` on the GGUF itself (Q4_1 for SmolLM2), greedy.

Runs in benchmarks/.peers/llama-cpp-python. llama-cpp-python serves one sequence at a time, so the
throughput workload runs the requests one after another (tok/s is then its single-stream rate with
prefill included). ``Llama.generate`` never stops by itself on EOS (that check lives in
``create_completion``), so reading exactly ``n`` tokens is ignore_eos.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class Engine:
    name = "llama-cpp-python"

    def __init__(self, w: dict, args):
        from llama_cpp import Llama

        longest = max(len(p) for p in w["prompts"] + [w["latency_prompt"]])
        n_ctx = longest + max(w["output_len"], w["latency_output_len"]) + 16
        n_ctx = max(512, (n_ctx + 255) // 256 * 256)
        self.llm = Llama(model_path=w["gguf"], n_ctx=n_ctx, n_batch=512, n_threads=args.threads,
                         n_threads_batch=args.threads, seed=0, verbose=False)
        self.info = {"n_ctx": n_ctx, "weights": os.path.basename(w["gguf"])}

    def version(self) -> str:
        import llama_cpp
        return f"llama-cpp-python {llama_cpp.__version__}"

    def _run(self, prompt, n):
        times = []
        t = time.perf_counter()
        if n <= 0:
            return t, times
        self.llm.reset()
        for _tok in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                      repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) >= n:
                break
        return t, times

    def generate(self, prompts, n) -> int:
        return sum(len(self._run(p, n)[1]) for p in prompts)

    def stream(self, prompt, n):
        t, times = self._run(prompt, n)
        return times[0] - t, times[-1] - t, len(times)


if __name__ == "__main__":
    _common.run(Engine, _common.parse_args())
