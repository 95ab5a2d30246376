"""Integer-dot GGUF path (issue 29): kernel M sweep, end-to-end modes, perplexity.

    PYTHONPATH=. .venv/bin/python benchmarks/intdot_bench.py --gemm-only --json-output gemm.json
    PYTHONPATH=. .venv/bin/python benchmarks/intdot_bench.py --e2e --repeats 2 --json-output e2e.json
    PYTHONPATH=. .venv/bin/python benchmarks/intdot_bench.py --ppl --json-output ppl.json
    (no flag: the older GEMV microbenchmark and PAGEDLLM_GGUF_INTDOT=1 vs 0 decode)

``--gemm-only``: per layer shape of SmolLM2 Q4_1 / Gemma 3 Q4_K_M and M = 1..256, the median wall
time of each kernel (1 thread, random codes in the layer's layout, kernels interleaved call by
call so they see the same load): group_gemm with bf16 (the engine's dtype here) and float32
activations, F.linear on the dequantized bf16 weight, intdot on each ISA path (portable at M = 1, 8).
``--e2e``: each mode of ``E2E_MODES`` in its own process (SmolLM2 Q4_1, ``--threads``): single-stream
decode tok/s, a 512-token prefill, decode steps of M = 1..6 single-token rows (a k+1-token verify's
rows) and the builtin 64-request offline workload. ``--ppl``: ``PPL_CASES``, the 400-token text.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [  # (label, M, K, N, kind, mins): SmolLM2's decode GEMVs; the LM head is Q8_0 (tied embedding)
    ("down 1x1536->576 Q4_1", 1, 1536, 576, 0, True),
    ("gate/up 1x576->1536 Q4_1", 1, 576, 1536, 0, True),
    ("lm_head 1x576->49152 Q8_0", 1, 576, 49152, 1, False),
    ("gate/up 2x576->1536 Q4_1", 2, 576, 1536, 0, True),
    ("gate/up 4x576->1536 Q4_1", 4, 576, 1536, 0, True),
    ("gate/up 8x576->1536 Q4_1", 8, 576, 1536, 0, True),
    ("gate/up 16x576->1536 Q4_1", 16, 576, 1536, 0, True),
]


def _cpu() -> dict:
    info = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and "model" not in info:
                    info["model"] = line.split(":", 1)[1].strip()
                if line.startswith("flags") and "flags" not in info:
                    fl = line.split(":", 1)[1].split()
                    info["simd_flags"] = sorted(x for x in fl if x.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    info["cpu_count"] = os.cpu_count()
    return info


def micro(reps: int) -> list[dict]:
    import torch

    from pagedllm.kernels.cpu_ops import get_intdot_ops, get_quant_ops
    from pagedllm.quantization import group_quant as gq

    torch.set_num_threads(1)
    new, old = get_intdot_ops(), get_quant_ops()
    out = []
    for label, m, k, n, kind, with_mins in SHAPES:
        g = torch.Generator().manual_seed(0)
        if kind == 0:
            q = gq.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
        else:
            q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, k // 32, generator=g) * 0.01
        mn = -torch.rand(n, k // 32, generator=g) * 0.05 if with_mins else None
        x = torch.randn(m, k, generator=g)
        fns = {"old_group_gemm": lambda: old.group_gemm(x, q, s, mn, None, kind, 32, 16, torch.float32)}
        for isa in (1, 2):
            if new.intdot_isa_supported(isa):
                name = new.intdot_isa_name(isa)
                fns[f"intdot_{name}"] = (lambda i: lambda: new.intdot_gemm(x, q, s, mn, None, kind, 32,
                                                                             torch.float32, i))(isa)
        times = {k_: [] for k_ in fns}
        r = max(5, reps // 20) if n > 10000 else reps
        for f in fns.values():
            f()
        for _ in range(r):
            for name, f in fns.items():
                t = time.perf_counter()
                f()
                times[name].append((time.perf_counter() - t) * 1e6)
        row = {"case": label, "us_median": {k_: round(statistics.median(v), 1) for k_, v in times.items()}}
        best = min(v for k_, v in row["us_median"].items() if k_ != "old_group_gemm")
        row["speedup_vs_old"] = round(row["us_median"]["old_group_gemm"] / best, 2)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


GEMM_SHAPES = [  # (label, K, N, kind, mins, group, max M): the layers of the two test models
    ("SmolLM2 qkv Q4_1 576->960", 576, 960, 0, True, 32, 1024),
    ("SmolLM2 gate/up Q4_1 576->3072", 576, 3072, 0, True, 32, 1024),
    ("SmolLM2 down Q4_1 1536->576", 1536, 576, 0, True, 32, 1024),
    ("SmolLM2 lm_head Q8_0 576->49152", 576, 49152, 1, False, 32, 64),
    ("Gemma3 attn_output Q4_K 1024->640", 1024, 640, 0, True, 32, 256),
    ("Gemma3 gate/up Q5_0 640->2048", 640, 2048, 1, False, 32, 256),
    ("Gemma3 down Q6_K 2048->640", 2048, 640, 1, False, 16, 256),
]
GEMM_MS = [1, 2, 4, 6, 8, 16, 64, 256, 1024]


def _layer(k: int, n: int, kind: int, with_mins: bool, group: int):
    import torch

    from pagedllm.quantization import group_quant as gq

    g = torch.Generator().manual_seed(0)
    if kind == 0:
        q = gq.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // group, generator=g) * 0.01
    mn = -torch.rand(n, k // group, generator=g) * 0.05 if with_mins else None
    return q, s, mn


def gemm_sweep(min_time: float) -> list[dict]:
    """Per layer shape and M: median wall time (us, 1 thread) of each kernel, calls interleaved.

    group_gemm_bf16 is the default path today (engine dtype auto = bfloat16 where the CPU has native
    bf16: register path at M <= 16, dequantized bf16 tiles + oneDNN above); dequant_bf16 is
    ``--quantization none`` (F.linear on bf16 weights); intdot_* take float32 activations."""
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels.cpu_ops import get_intdot_ops, get_quant_ops
    from pagedllm.kernels.onednn import pack_bf16_weight
    from pagedllm.quantization import group_quant as gq

    torch.set_num_threads(1)
    new, old = get_intdot_ops(), get_quant_ops()
    out = []
    for label, k, n, kind, with_mins, group, max_m in GEMM_SHAPES:
        q, s, mn = _layer(k, n, kind, with_mins, group)
        w16 = gq.dequantize(q, s, mn, kind, group, k).bfloat16()
        wp = pack_bf16_weight(w16)  # the float mode's oneDNN-blocked weight (prepack_cpu_linears)
        for m in [m_ for m_ in GEMM_MS if m_ <= max_m]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            xb = x.bfloat16()
            fns = {
                "group_gemm_bf16": lambda: old.group_gemm(xb, q, s, mn, None, kind, group, 16, torch.bfloat16),
                "group_gemm_f32": lambda: old.group_gemm(x, q, s, mn, None, kind, group, 16, torch.float32),
                "dequant_bf16": lambda: F.linear(xb, w16),
            }
            if wp is not None:
                fns["packed_bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, wp, None, "none", [None], "")
            if group % 32 == 0:
                if m in (1, 8) and n < 10000:  # the scalar path: its cost, for the record
                    fns["intdot_portable"] = lambda: new.intdot_gemm(x, q, s, mn, None, kind, group, torch.float32, 0)
                for isa in (2, 1):
                    if new.intdot_isa_supported(isa):
                        fns[f"intdot_{new.intdot_isa_name(isa)}"] = (
                            lambda i: lambda: new.intdot_gemm(x, q, s, mn, None, kind, group, torch.float32, i))(isa)
            for f in fns.values():
                f()
            t0 = time.perf_counter()
            for f in fns.values():
                f()
            reps = max(5, min(400, int(min_time / max(1e-6, time.perf_counter() - t0))))
            times = {k_: [] for k_ in fns}
            for _ in range(reps):
                for name, f in fns.items():
                    t = time.perf_counter()
                    f()
                    times[name].append((time.perf_counter() - t) * 1e6)
            row = {"layer": label, "M": m, "us_median": {k_: round(statistics.median(v), 1) for k_, v in times.items()}}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


E2E_MODES = {  # name: (env, LLM kwargs); each pins PAGEDLLM_GGUF_INTDOT, so the names hold whatever the default is
    "intdot": ({"PAGEDLLM_GGUF_INTDOT": "1"}, {}),  # GGUF blocks on the integer-dot GEMM (int8 activations)
    "batch-invariant": ({"PAGEDLLM_GGUF_INTDOT": "1"}, {"batch_invariant": True}),  # + invariant attention / norms
    "group_gemm": ({"PAGEDLLM_GGUF_INTDOT": "0"}, {}),  # float activations
    "quantization-none": ({"PAGEDLLM_GGUF_INTDOT": "0"}, {"quantization": "none"}),  # dequantized at load (bf16 here)
}


def e2e_one(mode: str, threads: int, repeats: int, num_prompts: int) -> dict:
    """One mode in this process: single-stream decode tok/s (128 greedy tokens, best of ``repeats``),
    a 512-token prefill (tok/s, best of ``repeats``), decode-step cost of M = 1..6 single-token rows
    (the rows a k+1-token verify computes; ratio to M = 1) and the builtin 64-request offline
    workload (``pagedllm bench throughput``'s, 128 output tokens, greedy, ignore_eos)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import builtin_workload
    from pagedllm.quantization import group_quant as gq

    env, kw = E2E_MODES[mode]
    llm = LLM("SmolLM2-135M-Instruct", seed=0, num_threads=threads, kv_cache_memory=512 * 1024**2,
              enable_prefix_caching=False, **kw)
    tok = llm.get_tokenizer()
    vocab = tok.vocab_size
    p = "The history of the printing press begins"
    llm.generate([p], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    res = {"mode": mode, "env": env, "llm_kwargs": kw, "threads": threads, "intdot_path": gq.intdot_path()}

    def gen(prompts, n):
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        o = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, o

    best = 0.0
    for _ in range(repeats):
        t1, _ = gen([p], 1)
        t2, o = gen([p], 128)
        best = max(best, 127 / (t2 - t1))
    res["single_decode_tok_s"] = round(best, 2)
    long = [{"prompt_token_ids": [(1000 + 31 * j) % (vocab - 100) + 50 for j in range(512)]}]
    res["prefill_512_tok_s"] = round(max(512 / gen(long, 1)[0] for _ in range(repeats)), 1)
    prompts = [{"prompt_token_ids": [(1000 + 7919 * i + 31 * j) % (vocab - 100) + 50 for j in range(64)]} for i in range(6)]
    steps = {}
    for m in (1, 2, 3, 4, 5, 6):
        vals = []
        for _ in range(repeats):
            ta, _ = gen(prompts[:m], 1)
            tb, _ = gen(prompts[:m], 33)
            vals.append((tb - ta) / 32 * 1e3)
        steps[m] = round(min(vals), 3)
    res["decode_step_ms_by_rows"] = steps
    res["step_ratio_vs_1_row"] = {m: round(v / steps[1], 3) for m, v in steps.items()}
    work = builtin_workload(tok, num_prompts)
    t, outs = gen([{"prompt_token_ids": w} for w in work], 128)
    res["offline_64_out_tok_s"] = round(sum(len(o.outputs[0].token_ids) for o in outs) / t, 1)
    res["offline_64_s"] = round(t, 2)
    return res


def e2e(threads: int, repeats: int, num_prompts: int, modes: list[str]) -> list[dict]:
    out = []
    for mode in modes:
        env = dict(os.environ, PYTHONPATH=ROOT, **E2E_MODES[mode][0])
        p = subprocess.run([sys.executable, __file__, "--e2e-child", mode, "--threads", str(threads), "--repeats",
                            str(repeats), "--num-prompts", str(num_prompts)], env=env, capture_output=True, text=True,
                           cwd=ROOT)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[-1][7:]) if line else {"mode": mode, "error": p.stderr[-2000:]}
        r["loadavg"] = os.getloadavg()
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


PPL_CASES = [  # (model, mode, dtype): perplexity of the 400-token text in one prefill step
    ("smollm2", "quantization-none", "float32"), ("smollm2", "intdot", "float32"), ("smollm2", "intdot", "auto"),
    ("smollm2", "group_gemm", "auto"),
    ("gemma3", "quantization-none", "float32"), ("gemma3", "intdot", "float32"), ("gemma3", "intdot", "auto"),
    ("gemma3", "group_gemm", "auto"),
]


def ppl_one(model: str, mode: str, dtype: str) -> dict:
    """Perplexity of ``" ".join(_SENTENCES)``'s first 400 tokens (the text of
    tests/quantization/test_gguf_blocks.py and benchmarks/quant_bench.py ppl), one step."""
    import math

    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import _SENTENCES
    from pagedllm.loader import get_gemma3_gguf_path, get_smollm2_gguf_path
    from pagedllm.quantization import group_quant as gq

    path = get_smollm2_gguf_path() if model == "smollm2" else get_gemma3_gguf_path()
    llm = LLM(path, dtype=dtype, kv_cache_memory=64 * 1024**2, max_num_batched_tokens=512, seed=0,
              enable_prefix_caching=False, **E2E_MODES[mode][1])
    ids = llm.get_tokenizer().encode(" ".join(_SENTENCES), add_special_tokens=False)[:400]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    lps = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return {"model": model, "mode": mode, "dtype": dtype, "intdot_path": gq.intdot_path(),
            "perplexity": round(math.exp(-sum(lps) / len(lps)), 4)}


def decode_one(repeats: int) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.quantization import group_quant as gq

    llm = LLM("SmolLM2-135M-Instruct", seed=0, num_threads=1)
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    p = "The history of the printing press begins"
    llm.generate([p], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        t1 = time.perf_counter()
        o = llm.generate([p], sp, use_tqdm=False)[0]
        t2 = time.perf_counter()
        n = len(o.outputs[0].token_ids)
        best = max(best, (n - 1) / ((t2 - t1) - (t1 - t0)))
    return {"intdot": gq.INTDOT, "intdot_path": gq.intdot_path(), "single_decode_tok_s": round(best, 2),
            "text_head": o.outputs[0].text[:60]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-output")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--gemm-only", action="store_true", help="only the M sweep (gemm_sweep)")
    ap.add_argument("--e2e", action="store_true", help="only the end-to-end modes (E2E_MODES), each in its own process")
    ap.add_argument("--e2e-child", help=argparse.SUPPRESS)
    ap.add_argument("--ppl", action="store_true", help="only the perplexity cases (PPL_CASES), each in its own process")
    ap.add_argument("--ppl-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(E2E_MODES), help="comma list of E2E_MODES names")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per case of the M sweep")
    a = ap.parse_args()
    if a.e2e_child:
        print("RESULT " + json.dumps(e2e_one(a.e2e_child, a.threads, a.repeats, a.num_prompts)), flush=True)
        return
    if a.ppl_child:
        print("RESULT " + json.dumps(ppl_one(*a.ppl_child)), flush=True)
        return
    if a.ppl:
        rows = []
        for case in PPL_CASES:
            env = dict(os.environ, PYTHONPATH=ROOT, **E2E_MODES[case[1]][0])
            p = subprocess.run([sys.executable, __file__, "--ppl-child", *case], env=env, capture_output=True,
                               text=True, cwd=ROOT)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            rows.append(json.loads(line[-1][7:]) if line else {"case": case, "error": p.stderr[-2000:]})
            print(json.dumps(rows[-1]), flush=True)
        if a.json_output:
            with open(a.json_output, "w") as f:
                json.dump({"benchmark": "benchmarks/intdot_bench.py --ppl", "cpu": _cpu(), "ppl": rows}, f, indent=1)
        return
    if a.e2e:
        res = {"benchmark": "benchmarks/intdot_bench.py --e2e", "cpu": _cpu(), "loadavg_before": os.getloadavg(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "e2e": e2e(a.threads, a.repeats, a.num_prompts, a.modes.split(","))}
        if a.json_output:
            with open(a.json_output, "w") as f:
                json.dump(res, f, indent=1)
        return
    if a.gemm_only:
        res = {"benchmark": "benchmarks/intdot_bench.py --gemm-only", "cpu": _cpu(), "loadavg_before": os.getloadavg(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "gemm_1thread": gemm_sweep(a.min_time)}
        res["loadavg_after"] = os.getloadavg()
        if a.json_output:
            with open(a.json_output, "w") as f:
                json.dump(res, f, indent=1)
        return
    if a.decode_child:
        print("RESULT " + json.dumps(decode_one(a.repeats)), flush=True)
        return
    res = {"benchmark": "benchmarks/intdot_bench.py", "cpu": _cpu(), "loadavg_before": os.getloadavg(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "micro_1thread": micro(a.reps), "decode": []}
    if not a.skip_decode:
        for flag in ("0", "1", "0", "1"):
            env = dict(os.environ, PAGEDLLM_GGUF_INTDOT=flag, PYTHONPATH=ROOT)
            p = subprocess.run([sys.executable, __file__, "--decode-child", "--repeats", str(a.repeats)], env=env,
                               capture_output=True, text=True, cwd=ROOT)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else {"error": p.stderr[-2000:]}
            r["PAGEDLLM_GGUF_INTDOT"] = flag
            res["decode"].append(r)
            print(json.dumps(r), flush=True)
    res["loadavg_after"] = os.getloadavg()
    if a.json_output:
        with open(a.json_output, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
