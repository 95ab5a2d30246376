"""transformers peer: ``AutoModelForCausalLM.generate``, greedy, batched and left-padded.

Runs in benchmarks/.peers/transformers (pip: transformers, torch==2.13.0). Loads the HF directory
that compare.py exported from the GGUF (same dequantized weights pagedllm runs).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class _TimeStreamer:
    """generate(streamer=...) calls put() once with the prompt, then once per new token."""

    def __init__(self):
        self.times: list[float] = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self):
        pass


class Engine:
    name = "transformers"

    def __init__(self, w: dict, args):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        self.torch = torch
        dtype = getattr(torch, args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(w["hf_dir"], dtype=dtype).eval()
        self.pad = w.get("pad_token_id")
        if self.pad is None:
            self.pad = 0
        self.bs = args.batch_size
        self.info = {"dtype": args.dtype, "batch_size": args.batch_size}

    def version(self) -> str:
        import transformers
        return f"transformers {transformers.__version__}, torch {self.torch.__version__}"

    def _gen(self, chunk, n, streamer=None):
        torch = self.torch
        L = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), L), self.pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, L - len(p):] = torch.tensor(p)
            mask[j, L - len(p):] = 1
        with torch.inference_mode():
            g = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, pad_token_id=self.pad,
                                    streamer=streamer)
        return (g.shape[1] - L) * len(chunk)

    def generate(self, prompts, n) -> int:
        return sum(self._gen(prompts[i:i + self.bs], n) for i in range(0, len(prompts), self.bs))

    def stream(self, prompt, n):
        s = _TimeStreamer()
        t = time.perf_counter()
        self._gen([prompt], n, streamer=s)
        return s.times[0] - t, s.times[-1] - t, len(s.times)


if __name__ == "__main__":
    def extra(ap):
        ap.add_argument("--dtype", default="float32")
        ap.add_argument("--batch-size", type=int, default=16)
    _common.run(Engine, _common.parse_args(extra))
