"""Multi-LoRA throughput: the same offline workload with its requests spread over N adapters vs
the base model only, in one run (issue 23's benchmark).

Three engines in one process, timed in alternation (``--repeats`` rounds; medians):

* ``base``: a plain engine (no ``enable_lora``), every request on the base model;
* ``lora-engine/base``: an ``enable_lora`` engine, every request on the base model (the cost of
  having LoRA on: the wrapped projections with no adapter rows);
* ``lora-engine/1 adapter``: the same engine, every request on adapter 0 (only when N > 1);
* ``lora-engine/N adapters``: the same engine, request ``i`` on adapter ``i % N``.

``--num-prompts 1`` measures a single stream (``generate`` of one request).

The adapters are random PEFT-format files (every q/k/v/o/gate/up/down target at ``--rank``,
nonzero B) written for the model's shapes. Throughput = generated tokens / wall seconds of one
``LLM.generate`` of all requests (greedy, ``ignore_eos``). The ratio of interest is
``lora/N adapters`` over ``base`` (same run, so machine load mostly cancels).

    python benchmarks/lora_bench.py --num-prompts 64 --output-len 64 --adapters 4 --repeats 3 \
        --json-output lora-bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def write_adapters(root: str, n: int, rank: int, cfg, seed: int = 0) -> list[str]:
    """``n`` random PEFT adapters for a Llama-shaped ``cfg`` under ``root``; their paths."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    paths = []
    for a in range(n):
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for mod, (i, o) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{mod}"
                tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, i, generator=g) - 0.5) * (2 / i ** 0.5)
                tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.01
        d = os.path.join(root, f"adapter{a}")
        os.makedirs(d, exist_ok=True)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                       "target_modules": [m.split(".")[-1] for m in shapes]}, f)
        paths.append(d)
    return paths


def prompts(tokenizer, n: int) -> list[dict]:
    """``n`` chat prompts of mixed lengths (about 30 to 150 tokens)."""
    topics = ["the sea", "a mountain village", "the history of bread", "how bees make honey",
              "a rainy afternoon", "the first computers", "learning a new language", "a long train journey"]
    out = []
    for i in range(n):
        extra = " Please give details and examples." * (i % 6)
        text = f"Write a short story about {topics[i % len(topics)]} (story number {i}).{extra}"
        msgs = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append({"prompt_token_ids": list(ids)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--json-output", default=None)
    args = ap.parse_args(argv)

    from pagedllm import LLM, LoRARequest, SamplingParams

    common = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
                  quantization=args.quantization, seed=0)
    base = LLM(args.model, **common)
    lora = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    cfg = base.llm_engine.core.hf_config
    root = tempfile.mkdtemp(prefix="lora-bench-")
    paths = write_adapters(root, args.adapters, args.rank, cfg)
    lrs = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
    for lr in lrs:
        lora.add_lora(lr)
    ps = prompts(base.get_tokenizer(), args.num_prompts)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    spread = [lrs[i % len(lrs)] for i in range(len(ps))]
    runs = {"base": (base, None), "lora-engine/base": (lora, None)}
    if args.adapters > 1:
        runs["lora-engine/1 adapter"] = (lora, [lrs[0]] * len(ps))
    runs[f"lora-engine/{args.adapters} adapters"] = (lora, spread)

    def once(llm, loras) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False, lora_request=loras)
        dt = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    for llm, loras in runs.values():  # warm-up (kernels, allocator, adapter slots)
        llm.generate(ps[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                     lora_request=None if loras is None else loras[:4])
    results: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.repeats):
        for name, (llm, loras) in runs.items():
            tps = once(llm, loras)
            results[name].append(tps)
            print(f"round {r + 1}: {name:28s} {tps:8.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    key = f"lora-engine/{args.adapters} adapters"
    summary = {
        "model": args.model, "dtype": str(base.llm_engine.core.dtype).replace("torch.", ""),
        "num_prompts": args.num_prompts, "output_len": args.output_len, "adapters": args.adapters,
        "rank": args.rank, "repeats": args.repeats, "threads": args.threads, "quantization": args.quantization,
        "tok_per_s": results, "median_tok_per_s": med,
        "ratio_lora_vs_base": med[key] / med["base"],
        "ratio_lora_engine_base_vs_base": med["lora-engine/base"] / med["base"],
    }
    keys = ["median_tok_per_s", "ratio_lora_vs_base", "ratio_lora_engine_base_vs_base"]
    if "lora-engine/1 adapter" in med:
        summary["ratio_one_adapter_vs_base"] = med["lora-engine/1 adapter"] / med["base"]
        keys.append("ratio_one_adapter_vs_base")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
