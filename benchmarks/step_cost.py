"""Cost of a decode step against the number of token rows it computes (what speculation pays for).

A verification of ``k`` drafts computes ``k + 1`` one-token attention rows of one request
(docs/speculative_decoding.md, "How a step works"), so its cost is that of a decode step over
``k + 1`` rows; this measures decode steps of ``M`` single-token requests, M = 1..8, for each
``--quantization`` given (default GGUF: the blocks kept quantized; ``none``: dequantized at load).

Per-step time = (time to generate ``1 + --steps`` tokens - time to generate 1 token) / ``--steps``
for ``M`` short distinct prompts at once (greedy, ``ignore_eos``), so the prefill cancels out.
Configurations and ``M`` alternate ``--repeats`` times; medians are reported, with the ratio to
``M = 1`` of the same configuration (a same-run ratio; absolute times depend on the host's load).

    PYTHONPATH=. python benchmarks/step_cost.py --quantization default,none \\
        --json-output benchmarks/results/step-cost-DATE.json

``--linears``: instead of engine steps, time only the weight GEMMs of one forward over ``M`` rows
(every ``Linear`` of the model, each on random ``[M, in_features]`` input, plus
``compute_logits``), ``--repeats`` times per ``M`` (alternating), medians and minima (on a loaded host the
minimum is the better estimate of the uncontended cost). Far less noisy on a
loaded host than engine steps, and it isolates what the GEMM kernels do with extra rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    from pagedllm import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", default="default,none", help="comma list; 'default' = LLM's default")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--linears", action="store_true")
    ap.add_argument("--json-output", default=None)
    args = ap.parse_args()
    if args.linears:
        return linears(args)

    quants = args.quantization.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    llms = {q: LLM(args.model, num_threads=args.num_threads, seed=0, kv_cache_memory=256 * 1024**2,
                   quantization=None if q == "default" else q) for q in quants}
    vocab = llms[quants[0]].get_tokenizer().vocab_size
    prompts = [[(1000 + 7919 * i + 31 * j) % (vocab - 100) + 50 for j in range(args.prompt_len)] for i in range(max(rows))]

    def timed(llm, m: int, n: int) -> float:
        llm.reset_prefix_cache()
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts[:m]], sp, use_tqdm=False)
        return time.perf_counter() - t0

    res = {q: {m: [] for m in rows} for q in quants}
    loadavg_start = os.getloadavg()
    for rep in range(args.repeats + 1):
        for m in rows:
            for q in quants:
                full = timed(llms[q], m, 1 + args.steps)
                one = timed(llms[q], m, 1)
                if rep:  # rep 0 warms up
                    res[q][m].append((full - one) / args.steps * 1e3)
    out = {"model": args.model, "threads": args.num_threads, "steps": args.steps, "prompt_len": args.prompt_len,
           "repeats": args.repeats, "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(), "configs": {}}
    for q in quants:
        base = statistics.median(res[q][rows[0]])
        out["configs"][q] = {str(m): {"ms_per_step": statistics.median(v), "runs_ms": v,
                                      "ratio_vs_first": statistics.median(v) / base} for m, v in res[q].items()}
        print(q, {m: (round(r["ms_per_step"], 2), round(r["ratio_vs_first"], 2))
                  for m, r in out["configs"][q].items()}, flush=True)
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(out, f, indent=2)


def linears(args) -> None:
    """The ``--linears`` mode (module docstring)."""
    import torch

    from pagedllm import LLM
    from pagedllm.models.layers import Linear

    torch.set_num_threads(args.num_threads)
    quants = args.quantization.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    models = {}
    for q in quants:
        llm = LLM(args.model, num_threads=args.num_threads, seed=0, kv_cache_memory=64 * 1024**2,
                  quantization=None if q == "default" else q)
        models[q] = llm.llm_engine.core.executor.driver_worker.model
    res = {q: {m: [] for m in rows} for q in quants}
    loadavg_start = os.getloadavg()
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            for m in rows:
                for q, model in models.items():
                    lins = [mod for mod in model.modules() if isinstance(mod, Linear)]
                    xs = [torch.randn(m, lin.in_features) for lin in lins]
                    h = torch.randn(m, xs[0].shape[1])
                    t0 = time.perf_counter()
                    for lin, x in zip(lins, xs):
                        lin(x)
                    model.compute_logits(h)
                    if rep:
                        res[q][m].append((time.perf_counter() - t0) * 1e3)
    out = {"model": args.model, "mode": "linears", "threads": args.num_threads, "repeats": args.repeats,
           "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(), "configs": {}}
    for q in quants:
        base = statistics.median(res[q][rows[0]])
        bmin = min(res[q][rows[0]])
        out["configs"][q] = {str(m): {"ms": statistics.median(v), "runs_ms": v,
                                      "ratio_vs_first": statistics.median(v) / base,
                                      "min_ms": min(v), "min_ratio_vs_first": min(v) / bmin}
                             for m, v in res[q].items()}
        print(q, "median", {m: (round(r["ms"], 2), round(r["ratio_vs_first"], 2)) for m, r in out["configs"][q].items()},
              "min", {m: (round(r["min_ms"], 2), round(r["min_ratio_vs_first"], 2)) for m, r in out["configs"][q].items()},
              flush=True)
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
