"""Integer-dot GEMM (issue 29 item 1): GEMV microbenchmark new vs old kernel, and single-stream
decode of the default model with PAGEDLLM_GGUF_INTDOT=1 vs 0 (each in its own process).

    PYTHONPATH=. .venv/bin/python benchmarks/intdot_bench.py --json-output benchmarks/results/intdot-<date>.json

Microbenchmark: 1 thread, random codes in the layer's layout; the median of ``--reps`` timed calls
per case, the kernels interleaved call by call so both see the same machine load. Decode: one
prompt, 128 greedy tokens (ignore_eos), tok/s over the decode phase, best of ``--repeats``.
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
    a = ap.parse_args()
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
