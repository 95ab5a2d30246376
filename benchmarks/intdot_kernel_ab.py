"""A/B of the integer-dot GEMM kernel (``pagedllm/kernels/csrc/intdot_gemm.cpp``) against the same
file at another git revision, in one process, calls interleaved (so both see the same load).

    PYTHONPATH=. .venv/bin/python benchmarks/intdot_kernel_ab.py --base-ref main \\
        --json-output benchmarks/results/intdot-kernel-ab-DATE.json

Per SmolLM2-135M Q4_1 layer shape (the fused projections the engine calls: qkv 576->960, o
576->576, gate_up 576->3072, down 1536->576, and the tied Q8_0 LM head 576->49152), per M (decode
M = 1, verify M = 2..8, 16) and per thread count: the median wall time in microseconds of each
kernel (activations and output in `--x-dtype`, default bf16; scales and mins in `--scale-dtype`,
default float16 as a GGUF file's layers hold them), random codes in the
layer's layout. ``layer_us`` sums the four projections (one decoder layer's GEMMs); ``ratio_vs_m1``
is that sum over the same kernel's M = 1 sum (what a k+1-row verify step costs in GEMMs).
The base module is built from ``git show REF:pagedllm/kernels/csrc/intdot_gemm.cpp`` with the same
flags as the engine's build (``cpu_ops._INTDOT_CFLAGS``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [  # (name, K, N, kind, mins)
    ("qkv", 576, 960, 0, True),
    ("o", 576, 576, 0, True),
    ("gate_up", 576, 3072, 0, True),
    ("down", 1536, 576, 0, True),
    ("lm_head", 576, 49152, 1, False),
]
LAYER = ("qkv", "o", "gate_up", "down")


def _base_module(ref: str):
    from pagedllm.kernels import cpu_ops

    tmp = tempfile.mkdtemp(prefix="intdot-base-")
    for f in ("intdot_gemm.cpp", "torch_lite.h", "cpu_utils.h"):
        src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:pagedllm/kernels/csrc/{f}"], check=True,
                             capture_output=True).stdout
        with open(os.path.join(tmp, f), "wb") as fh:
            fh.write(src)
    return cpu_ops.load_extension([os.path.join(tmp, "intdot_gemm.cpp")], "pagedllm_intdot_base",
                                  f"the integer-dot kernel at {ref}", cpu_ops._INTDOT_CFLAGS)


def _cpu() -> dict:
    info: dict = {"machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and "model" not in info:
                    info["model"] = line.split(":", 1)[1].strip()
                if line.startswith("flags") and "flags" not in info:
                    info["flags"] = sorted(x for x in line.split(":", 1)[1].split()
                                           if x.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-ref", default="main")
    ap.add_argument("--ms", default="1,2,3,4,5,6,8,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--min-time", type=float, default=0.15, help="seconds per kernel and case")
    ap.add_argument("--isa", type=int, default=-1, help="ISA path (-1 best, 0 portable, 1 avx2, 2 avx512vnni)")
    ap.add_argument("--with-cols", action="store_true",
                    help="also this checkout's columns kernel forced at every M ('new_cols')")
    ap.add_argument("--copies", type=int, default=1,
                    help="copies of each layer's weights, cycled call by call (30: SmolLM2's layers, so the "
                         "weights come from DRAM as in a decode step, not from the L3 cache)")
    ap.add_argument("--no-base", action="store_true", help="time only this checkout's kernel")
    ap.add_argument("--with-rows", action="store_true",
                    help="also this checkout's rows kernel forced at every M ('new_rows': the crossover)")
    ap.add_argument("--scale-dtype", default="float16", choices=("float16", "float32"),
                    help="dtype of the scales and mins (float16: as a GGUF file's layers are held)")
    ap.add_argument("--x-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="activation and output dtype (float32 on CPUs without native bf16)")
    ap.add_argument("--with-interleaved", action="store_true",
                    help="also this checkout's kernel given the interleaved scales ('new_inter', group_quant."
                         "interleave_scales)")
    ap.add_argument("--json-output")
    args = ap.parse_args()

    import torch

    from pagedllm.kernels.cpu_ops import get_intdot_ops
    from pagedllm.quantization import group_quant as gq

    mods = {"new": get_intdot_ops()}
    if not args.no_base:
        mods = {"base": _base_module(args.base_ref), **mods}
    ms = [int(m) for m in args.ms.split(",")]
    want = set(args.shapes.split(","))
    out: dict = {"cpu": _cpu(), "copies": args.copies, "base_ref": None if args.no_base else args.base_ref, "isa": args.isa, "scale_dtype": args.scale_dtype, "x_dtype": args.x_dtype,
                 "isa_name": mods["new"].intdot_isa_name(args.isa if args.isa >= 0 else mods["new"].intdot_best_isa()),
                 "loadavg_start": os.getloadavg(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "cases": []}
    layers = {}
    xdt = getattr(torch, args.x_dtype)
    for name, k, n, kind, with_mins in SHAPES:
        if name not in want:
            continue
        g = torch.Generator().manual_seed(0)
        if kind == 0:
            q = gq.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
        else:
            q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        sdt = getattr(torch, args.scale_dtype)
        s = (torch.rand(n, k // 32, generator=g) * 0.01).to(sdt)
        mn = (-torch.rand(n, k // 32, generator=g) * 0.05).to(sdt) if with_mins else None
        copies = 1 if name == "lm_head" else args.copies
        layers[name] = (k, [(q.clone(), s.clone(), None if mn is None else mn.clone()) for _ in range(copies)], kind)
    for th in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(th)
        for m in ms:
            for name, (k, ws, kind) in layers.items():
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdt)

                def call(mod, rows_min_m=0, ws=ws, x=x, kind=kind, start=0):
                    # each kernel starts a third of the way from the previous one in the copies, so
                    # that none reads a copy another kernel has just brought into the cache
                    cyc = itertools.cycle(ws[start:] + ws[:start])
                    return lambda: mod.intdot_gemm(x, *next(cyc), None, kind, 32, xdt, args.isa,
                                                   rows_min_m)
                fns = {key: call(mod, start=i * len(ws) // 3) for i, (key, mod) in enumerate(mods.items())}
                if args.with_interleaved:
                    wsi = [(q, s, mn, gq.interleave_scales(s, mn)) for q, s, mn in ws]
                    cyc_i = itertools.cycle(wsi[2 * len(ws) // 3:] + wsi[:2 * len(ws) // 3])

                    def inter(x=x, kind=kind, cyc=cyc_i):
                        q, s, mn, smt = next(cyc)
                        return mods["new"].intdot_gemm(x, q, s, mn, None, kind, 32, xdt, args.isa, 0, smt)
                    fns["new_inter"] = inter
                if args.with_rows:
                    fns["new_rows"] = call(mods["new"], 1, start=2 * len(ws) // 3)
                if args.with_cols:
                    fns["new_cols"] = call(mods["new"], 1 << 20, start=2 * len(ws) // 3)
                ref = None
                for key, f in fns.items():  # warm up; all kernels must agree bit for bit (first copy)
                    y = f()
                    ref = y if ref is None else ref
                    assert torch.equal(y, ref), f"{key} differs from base at {name} M={m}"
                    for _ in range(len(ws) - 1):
                        f()
                times: dict = {key: [] for key in fns}
                t_end = time.perf_counter() + args.min_time * len(fns)
                while time.perf_counter() < t_end or len(times["new"]) < 5:
                    for key, f in fns.items():
                        t0 = time.perf_counter()
                        f()
                        times[key].append((time.perf_counter() - t0) * 1e6)
                row = {"threads": th, "M": m, "shape": name, "us": {key: round(statistics.median(v), 1)
                                                                       for key, v in times.items()}}
                out["cases"].append(row)
                print(json.dumps(row), flush=True)
    # per thread count and M: one decoder layer's GEMMs, and its ratio to M = 1
    summary = []
    for th in sorted({c["threads"] for c in out["cases"]}):
        m1 = None
        for m in ms:
            cs = [c for c in out["cases"] if c["threads"] == th and c["M"] == m and c["shape"] in LAYER]
            if len(cs) != len(LAYER):
                continue
            lay = {key: round(sum(c["us"][key] for c in cs), 1) for key in cs[0]["us"]}
            m1 = m1 or lay
            summary.append({"threads": th, "M": m, "layer_us": lay,
                            "ratio_vs_m1": {key: round(lay[key] / m1[key], 2) for key in lay},
                            **({"speedup": round(lay["base"] / lay["new"], 2)} if "base" in mods else {})})
            print(json.dumps(summary[-1]), flush=True)
    out["layer_summary"] = summary
    out["loadavg_end"] = os.getloadavg()
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
