"""The CPU allocator options on the same offline workload, interleaved, in one run (issue 25).

Variants (each a fresh ``pagedllm bench throughput`` process):
  custom    pagedllm's caching allocator (the default; PAGEDLLM_CPU_ALLOCATOR=1)
  glibc     torch's allocator on glibc malloc (PAGEDLLM_CPU_ALLOCATOR=0)
  jemalloc  torch's allocator on jemalloc (LD_PRELOAD=libjemalloc.so.2), if installed
  tcmalloc  torch's allocator on tcmalloc (LD_PRELOAD=libtcmalloc_minimal.so.4), if installed
            (vLLM's CPU backend recommends tcmalloc through LD_PRELOAD)

For each run: output tokens/s (wall-clock: noisy on a shared machine), and the child's minor
page faults and peak RSS (its own getrusage: first-touch page faults are what the caching
allocator exists to avoid, and they are counted exactly whatever else the machine does).

    python benchmarks/allocator_compare.py --repeats 3 [--quantization w8a8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LIBS = {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
        "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}


def run_once(variant: str, extra: list[str]) -> dict:
    env = dict(os.environ)
    env["PAGEDLLM_CPU_ALLOCATOR"] = "1" if variant == "custom" else "0"
    if variant in LIBS:
        env["LD_PRELOAD"] = LIBS[variant]
    out = subprocess.run([sys.executable, "-c", _CHILD, *extra], env=env, capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout[out.stdout.index("{"):out.stdout.index("RUSAGE")])
    ru = json.loads(out.stdout.split("RUSAGE", 1)[1])
    return {"output_tokens_per_s": res["output_tokens_per_s"], **ru}


# The child: the bench in-process, then its own resource usage (minor faults, peak RSS).
_CHILD = """
import json, resource, sys
from pagedllm.entrypoints.cli import main
main(["bench", "throughput", "--json", *sys.argv[1:]])
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RUSAGE" + json.dumps({"minor_faults": ru.ru_minflt, "peak_rss_mib": ru.ru_maxrss / 1024}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="custom,glibc,jemalloc,tcmalloc")
    ap.add_argument("--json", default=None, help="write the raw runs here")
    args, extra = ap.parse_known_args()
    variants = [v for v in args.variants.split(",") if v not in LIBS or os.path.exists(LIBS[v])]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:  # interleaved: slow phases of a shared machine hit every variant
            runs[v].append(run_once(v, extra))
            print(f"repeat {r} {v}: {runs[v][-1]}", flush=True)
    base = statistics.median(x["output_tokens_per_s"] for x in runs["custom"]) if "custom" in runs else None
    print(f"{'variant':<10} {'tok/s (median)':>15} {'vs custom':>10} {'minor faults':>13} {'peak RSS MiB':>13}")
    for v, rs in runs.items():
        tps = statistics.median(x["output_tokens_per_s"] for x in rs)
        faults = statistics.median(x["minor_faults"] for x in rs)
        ratio = f"{tps / base:.3f}" if base else "-"
        rss = statistics.median(x["peak_rss_mib"] for x in rs)
        print(f"{v:<10} {tps:>15.1f} {ratio:>10} {faults:>13.0f} {rss:>13.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": extra, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
