"""Shared driver for the per-engine helper scripts in this folder.

Each helper runs inside its peer's own venv (``benchmarks/.peers/<name>/bin/python``), so this file
imports nothing beyond the standard library. ``compare.py`` writes the workload (token ids from
pagedllm's tokenizer) to a JSON file and starts the helper as a fresh process; the helper loads the
model, then, in this order and in the same process:

1. ``startup``: one 1-token request; reports ``startup_to_first_token_s`` counted from the moment
   compare.py spawned the process (env ``COMPARE_SPAWN_UNIX``), so interpreter start, imports and
   model load are all included.
2. ``latency``: one request of ``latency_prompt`` (``latency_output_len`` tokens, greedy,
   ignore_eos), one warm-up iteration then ``--latency-iters`` timed ones; TTFT and TPOT medians.
3. ``throughput``: a 2-request warm-up, then every prompt of the workload at once (or in the
   engine's natural way: batches for transformers, one after another for llama-cpp-python).

The last stdout line is ``COMPARE_RESULT {json}``.

An engine class provides::

    name: str
    def __init__(self, workload: dict, args): ...          # load the model
    def version(self) -> str
    def generate(self, prompts: list[list[int]], output_len: int) -> int     # output tokens made
    def stream(self, prompt: list[int], output_len: int) -> tuple[float, float, int]
        # (seconds to first token, seconds to last token, tokens made), counted from the call
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback


class VllmStyleEngine:
    """Shared driver for engines with vLLM's offline API (pagedllm and vLLM itself): subclasses
    set ``self.llm`` (an ``LLM``) and ``self.SamplingParams`` in ``__init__``."""

    def _gen(self, prompts, n):
        sp = self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def generate(self, prompts, n) -> int:
        return self._gen(prompts, n)

    def stream(self, prompt, n):
        """(TTFT s, decode-run s, tokens made); prefix caching is reset so the second call's
        prefill is not free."""
        self.llm.reset_prefix_cache()
        t = time.perf_counter()
        self._gen([prompt], 1)
        first = time.perf_counter() - t
        if n <= 1:
            return first, first, 1
        self.llm.reset_prefix_cache()
        t = time.perf_counter()
        made = self._gen([prompt], n)
        return first, time.perf_counter() - t, made


def parse_args(extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, help="workload JSON written by compare.py")
    ap.add_argument("--modes", default="startup,latency,throughput")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--latency-iters", type=int, default=3)
    if extra:
        extra(ap)
    return ap.parse_args()


def run(engine_cls, args: argparse.Namespace) -> None:
    spawn = float(os.environ.get("COMPARE_SPAWN_UNIX") or time.time())
    with open(args.workload) as f:
        w = json.load(f)
    modes = [m for m in args.modes.split(",") if m]
    res: dict = {"engine": engine_cls.name, "threads": args.threads}
    try:
        t0 = time.perf_counter()
        eng = engine_cls(w, args)
        res["load_s"] = time.perf_counter() - t0
        res["version"] = eng.version()
        res.update(getattr(eng, "info", {}))
        if "startup" in modes:
            eng.stream(w["latency_prompt"], 1)
            res["startup_to_first_token_s"] = time.time() - spawn
        if "latency" in modes:
            n = w["latency_output_len"]
            ttft, tpot, lat = [], [], []
            for it in range(args.latency_iters + 1):
                first, last, made = eng.stream(w["latency_prompt"], n)
                if it == 0:
                    continue  # warm-up
                ttft.append(first)
                lat.append(last)
                tpot.append((last - first) / max(1, made - 1))
            res.update({
                "latency_input_len": len(w["latency_prompt"]), "latency_output_len": n,
                "avg_latency_s": statistics.mean(lat),
                "median_ttft_ms": 1000 * statistics.median(ttft),
                "median_tpot_ms": 1000 * statistics.median(tpot),
                "decode_tokens_per_s": 1.0 / statistics.median(tpot) if statistics.median(tpot) > 0 else 0.0,
            })
        if "throughput" in modes:
            prompts = w["prompts"]
            out_len = w["output_len"]
            eng.generate(prompts[:2], min(4, out_len))  # warm-up, not timed
            t = time.perf_counter()
            n_out = eng.generate(prompts, out_len)
            el = time.perf_counter() - t
            n_in = sum(len(p) for p in prompts)
            res.update({
                "num_requests": len(prompts), "total_prompt_tokens": n_in,
                "total_output_tokens": n_out, "elapsed_s": el,
                "requests_per_s": len(prompts) / el, "output_tokens_per_s": n_out / el,
                "total_tokens_per_s": (n_in + n_out) / el,
            })
    except Exception as e:  # report, don't hide: compare.py shows the error in its table
        traceback.print_exc()
        res["error"] = f"{e.__class__.__name__}: {e}"
    sys.stdout.flush()
    print("COMPARE_RESULT " + json.dumps(res), flush=True)
