"""Paged decode attention on CPU: microseconds per call (one decoder layer of one request), the
grouped kernel against the per-head ``decode_one`` kernel (``PAGEDLLM_DECODE_GENERIC=1``).

Each kernel runs in its own process (the switch is read once per process), one torch thread,
SmolLM2's heads by default (9 query heads, 3 kv heads, head size 64), a block size of 16 and a
shuffled block table, at several context lengths; q float32 with a bf16 cache (the float32
activation path of CPUs without AVX512-BF16) unless ``--q-dtype bfloat16``.

    python benchmarks/decode_attention_bench.py --output-json benchmarks/results/decode-attention-DATE.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CHILD = r"""
import json, random, sys, time, torch
torch.set_num_threads(1)
from pagedllm.kernels.cpu_ops import get_ops
ops = get_ops()
hq, hkv, d, qd, kvd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
ctxs = [int(x) for x in sys.argv[6].split(",")]
bs = 16
out = {}
for ctx in ctxs:
    nb = (ctx + bs - 1) // bs
    kv = torch.randn(nb + 8, 2, bs, hkv, d).to(getattr(torch, kvd))
    perm = list(range(1, nb + 8)); random.Random(0).shuffle(perm)
    bt = torch.tensor([perm[:nb]], dtype=torch.long)
    sl = torch.tensor([ctx], dtype=torch.long)
    q = torch.randn(1, hq, d).to(getattr(torch, qd))
    f = lambda: ops.paged_decode_attention(q, kv, bt, sl, d ** -0.5, 0, 0.0)
    for _ in range(20): f()
    best = float("inf")
    for _ in range(5):
        n = max(20, 200000 // ctx)
        t = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t) / n)
    out[ctx] = round(best * 1e6, 2)
print("RESULT " + json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size")
    ap.add_argument("--q-dtype", default="float32")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--contexts", default="64,190,512,1024,2048")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from pagedllm.entrypoints.bench import machine_report
    hq, hkv, d = args.heads.split(",")
    res: dict = {"machine": machine_report(), "args": vars(args), "loadavg_start": os.getloadavg(), "us": {}}
    for name, generic in (("grouped", "0"), ("per_head", "1")):
        env = dict(os.environ, PAGEDLLM_DECODE_GENERIC=generic, OMP_NUM_THREADS="1")
        p = subprocess.run([sys.executable, "-c", CHILD, hq, hkv, d, args.q_dtype, args.kv_dtype, args.contexts],
                           env=env, capture_output=True, text=True, check=True)
        line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
        res["us"][name] = json.loads(line[len("RESULT "):])
    res["speedup"] = {c: round(res["us"]["per_head"][c] / res["us"]["grouped"][c], 2) for c in res["us"]["grouped"]}
    res["loadavg_end"] = os.getloadavg()
    print(json.dumps({k: res[k] for k in ("us", "speedup", "loadavg_start")}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
