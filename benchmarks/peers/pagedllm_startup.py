"""pagedllm's start-up to first token, measured like the peers' (see _common.py): spawn -> import
-> load -> one 1-token request. Runs in pagedllm's own venv. Throughput and latency for pagedllm come
from ``pagedllm bench throughput|latency --json`` (compare.py runs those), so only ``startup``
is meaningful here, though the other modes work too (they go through ``LLM.generate``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class Engine(_common.VllmStyleEngine):
    name = "pagedllm"

    def __init__(self, w: dict, args):
        from pagedllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        kw = {"quantization": args.quantization} if args.quantization else {}
        self.llm = LLM(w["gguf"], dtype=args.dtype, num_threads=args.threads, **kw)
        self.info = {"dtype": str(self.llm.llm_engine.core.dtype), "quantization": args.quantization}

    def version(self) -> str:
        import pagedllm
        import torch
        return f"pagedllm {pagedllm.__version__}, torch {torch.__version__}"


if __name__ == "__main__":
    def extra(ap):
        ap.add_argument("--dtype", default="auto")
        ap.add_argument("--quantization", default=None)
    _common.run(Engine, _common.parse_args(extra))
