#!/usr/bin/env python
"""Model-coverage benchmarks (issue 22), each a same-run ratio:

- ``moe``: a random Qwen3-MoE with realistic expert counts (64 experts, top-8, hidden 512,
  expert size 256, 4 layers), offline generation with the experts as one grouped GEMM
  (``torch._grouped_mm``, the default) vs one matmul per expert (``FusedMoE.use_grouped_mm = False``).
- ``fallback``: a random Llama (hidden 512, 4 layers) through the transformers fallback
  (``model_impl="transformers"``) vs the native model.

Both engines of a pair are built once and run alternately (``--repeats`` rounds, A B A B ...); the
figure is total tokens (prompt + output) per second, best of the rounds; the ratio is the median of the
rounds' A/B ratios (adjacent runs, so slow drift in the machine's load cancels), beside the ratio of
the bests.
Weights are ``load_format="dummy"`` (the model's shapes and compute, no checkpoint files).

    PYTHONPATH=. python benchmarks/models_bench.py --threads 1 --repeats 3 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _checkpoint(kind: str) -> str:
    """A config + tokenizer directory (no weights) for ``kind`` ("moe" or "llama")."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = 1024
    common = dict(vocab_size=vocab, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if kind == "moe":
        cfg = tf.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                                num_experts=64, num_experts_per_tok=8, norm_topk_prob=True)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = tf.LlamaConfig(**common, intermediate_size=1536)
        cfg.architectures = ["LlamaForCausalLM"]
    d = tempfile.mkdtemp(prefix=f"pagedllm-bench-{kind}-")
    cfg.save_pretrained(d)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(d)
    return d


def _workload(n: int, prompt_len: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 1024) for _ in range(prompt_len)]} for _ in range(n)]


def _run(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return secs, tokens


def _pair(name: str, a, b, labels: tuple[str, str], prompts, max_tokens: int, repeats: int,
          setup_a=None, setup_b=None) -> dict:
    best = {labels[0]: 0.0, labels[1]: 0.0}
    runs = {labels[0]: [], labels[1]: []}
    _run(a, prompts[:2], 4)  # warm-up (first-call allocations)
    _run(b, prompts[:2], 4)
    for _ in range(repeats):
        for label, llm, setup in ((labels[0], a, setup_a), (labels[1], b, setup_b)):
            if setup:
                setup()
            secs, tokens = _run(llm, prompts, max_tokens)
            runs[label].append(round(tokens / secs, 1))
            best[label] = max(best[label], tokens / secs)
    import statistics

    pairs = [x / y for x, y in zip(runs[labels[0]], runs[labels[1]])]
    res = {"bench": name, "requests": len(prompts), "prompt_tokens": len(prompts[0]["prompt_token_ids"]),
           "max_tokens": max_tokens, "tok_per_s_runs": runs,
           "best_tok_per_s": {k: round(v, 1) for k, v in best.items()},
           "ratio_of_bests": round(best[labels[0]] / best[labels[1]], 3),
           "median_pair_ratio": round(statistics.median(pairs), 3)}
    print(json.dumps(res), flush=True)
    return res


def bench_moe(args) -> dict:
    from pagedllm import LLM
    from pagedllm.models.moe import FusedMoE

    d = _checkpoint("moe")
    llm = LLM(d, dtype=args.dtype, load_format="dummy", num_threads=args.threads, max_num_seqs=args.requests,
              kv_cache_memory=512 * 1024**2, seed=0)
    experts = [m for m in llm.llm_engine.core.model.modules() if isinstance(m, FusedMoE)]
    assert experts and experts[0].num_experts == 64

    def use(grouped: bool):
        def set_():
            for m in experts:
                m.use_grouped_mm = grouped
        return set_

    # NOTE: one engine, the expert kernel switched between runs: everything else is identical.
    return _pair("moe grouped GEMM vs per-expert loop (Qwen3-MoE 64 experts top-8, hidden 512)", llm, llm,
                 ("grouped", "loop"), _workload(args.requests, args.prompt_len), args.max_tokens, args.repeats,
                 use(True), use(False))


def bench_fallback(args) -> dict:
    from pagedllm import LLM

    d = _checkpoint("llama")
    kw = dict(dtype=args.dtype, load_format="dummy", num_threads=args.threads, max_num_seqs=args.requests,
              kv_cache_memory=512 * 1024**2, seed=0)
    fallback = LLM(d, model_impl="transformers", **kw)
    native = LLM(d, model_impl="pagedllm", **kw)
    return _pair("transformers fallback vs native (Llama hidden 512, 4 layers)", fallback, native,
                 ("fallback", "native"), _workload(args.requests, args.prompt_len), args.max_tokens, args.repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", choices=["moe", "fallback", "all"], default="all")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    results = []
    if args.bench in ("moe", "all"):
        results.append(bench_moe(args))
    if args.bench in ("fallback", "all"):
        results.append(bench_fallback(args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"threads": args.threads, "dtype": args.dtype, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
