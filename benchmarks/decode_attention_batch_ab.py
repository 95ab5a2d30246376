"""Batched paged decode attention on CPU: the request-wise split (default) against the
per-(request, kv head) split (``PAGEDLLM_DECODE_PER_HEAD=1``), one process, calls alternated.

The offline workload's shape: 64 requests of 50-430 context tokens (a 50-300-token prompt plus up
to 127 generated tokens), SmolLM2's heads (9 query / 3 kv, head size 64), block size 16, and one
KV cache per layer (30 by default) cycled call by call, so that K/V come from DRAM as in a decode
step rather than from the L3 cache (``--layers 1``: cache-resident). Reports microseconds per
layer (median of ``--reps`` passes over the layers) and the K/V bytes read per second; checks
that both splits give bit-identical outputs first.

    python benchmarks/decode_attention_batch_ab.py --q-dtype bfloat16 \\
        --output-json benchmarks/results/decode-attention-batch-DATE.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="KV caches cycled (1: cache-resident)")
    ap.add_argument("--q-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shuffle-blocks", action="store_true", help="scatter the block table (default: in order)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import torch

    from pagedllm.kernels.cpu_ops import get_ops

    ops = get_ops()
    if ops is None:
        sys.exit("the C++ CPU kernels are not available")
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    bs = 16
    rng = random.Random(0)
    ctx = [rng.randint(50, 300) + rng.randint(0, 127) for _ in range(args.requests)]
    nbs = [(c + bs - 1) // bs for c in ctx]
    tot = sum(nbs)
    kvdt = getattr(torch, args.kv_dtype)
    kvs = [(torch.randn(tot + 1, 2, bs, hkv, d) * 0.5).to(kvdt) for _ in range(args.layers)]
    ids = list(range(1, tot + 1))
    if args.shuffle_blocks:
        rng.shuffle(ids)
    bt = torch.zeros(args.requests, max(nbs), dtype=torch.long)
    i = 0
    for b, n in enumerate(nbs):
        bt[b, :n] = torch.tensor(ids[i:i + n])
        i += n
    sl = torch.tensor(ctx, dtype=torch.long)
    q = torch.randn(args.requests, hq, d).to(getattr(torch, args.q_dtype))
    kv_bytes = sum(ctx) * hkv * d * 2 * kvs[0].element_size()

    def call(kv):
        return ops.paged_decode_attention(q, kv, bt, sl, d ** -0.5, 0, 0.0)

    out = {"heads": [hq, hkv, d], "requests": args.requests, "context_tokens": sum(ctx), "layers": args.layers,
           "q_dtype": args.q_dtype, "kv_dtype": args.kv_dtype, "kv_bytes_per_layer": kv_bytes,
           "shuffled_blocks": args.shuffle_blocks, "loadavg_start": os.getloadavg(),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cases": []}
    with open("/proc/cpuinfo") as f:
        out["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    for th in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(th)
        ref = {}
        for mode in ("1", "0"):
            os.environ["PAGEDLLM_DECODE_PER_HEAD"] = mode
            for kv in kvs:
                call(kv)
            ref[mode] = call(kvs[0])
        assert torch.equal(ref["0"], ref["1"]), "the two splits differ"
        times: dict = {"per_head": [], "request_wise": []}
        for _ in range(args.reps):
            for mode, key in (("1", "per_head"), ("0", "request_wise")):
                os.environ["PAGEDLLM_DECODE_PER_HEAD"] = mode
                t = time.perf_counter()
                for kv in kvs:
                    call(kv)
                times[key].append((time.perf_counter() - t) / len(kvs))
        os.environ.pop("PAGEDLLM_DECODE_PER_HEAD", None)
        row = {"threads": th}
        for key, v in times.items():
            m = statistics.median(v)
            row[key] = {"us_per_layer": round(m * 1e6, 1), "GB_per_s": round(kv_bytes / m / 1e9, 2)}
        row["speedup"] = round(row["per_head"]["us_per_layer"] / row["request_wise"]["us_per_layer"], 2)
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
    out["loadavg_end"] = os.getloadavg()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
