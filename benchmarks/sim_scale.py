"""The simulator at fleet scale: a curve from 1 to 1,000 replicas per routing policy, and the wall
time of the simulation itself.

    PYTHONPATH=. python benchmarks/sim_scale.py \\
        --step-model benchmarks/results/sim-step-model-DATE.json \\
        --json-output benchmarks/results/sim-scale-DATE.json

Workload: the multi-turn chat generator (8 turns a conversation, shared system prompts), at
``--rate-per-replica`` requests/s per replica (the fleet's load per replica stays constant along the
curve), conversations starting over ``--duration-s``. Each point reports the simulated fleet's output
throughput, TTFT / ITL percentiles, prefix cache hit rate, mean KV usage, and the simulator's wall
time (``wall_s``; the trace generation is not included, ``gen_s`` gives it).
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    from pagedllm.sim.simulator import ReplicaConfig, simulate
    from pagedllm.sim.step_model import StepModel
    from pagedllm.sim.trace import synthetic_trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-model", required=True)
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64,128,256,512,1000")
    ap.add_argument("--policies", default="prefix,least-load,round-robin,sticky")
    ap.add_argument("--rate-per-replica", type=float, default=0.1)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--kind", default="multi-turn")
    ap.add_argument("--json-output", default=None)
    args = ap.parse_args()
    model = StepModel.load(args.step_model)
    eng = model.engine
    cfg = ReplicaConfig(num_blocks=int(eng["num_blocks"]), block_size=int(eng["block_size"]),
                        max_num_seqs=int(eng["max_num_seqs"]), max_num_batched_tokens=int(eng["max_num_batched_tokens"]),
                        max_model_len=int(eng["max_model_len"]))
    out: dict = {"cpu": model.meta.get("cpu"), "loadavg_start": os.getloadavg(), "args": vars(args), "points": []}
    for n in [int(x) for x in args.replicas.split(",")]:
        t0 = time.perf_counter()
        trace = synthetic_trace(args.kind, rate=args.rate_per_replica * n, duration_s=args.duration_s, seed=0)
        gen = time.perf_counter() - t0
        for pol in args.policies.split(","):
            s = simulate(trace, n, pol, model, cfg, per_replica=False).summary
            pt = {"replicas": n, "policy": pol, "num_requests": s["num_requests"], "gen_s": round(gen, 3),
                  "wall_s": s["wall_s"], "simulated_s": s["simulated_s"], "num_steps": s["num_steps"],
                  "output_throughput_tok_s": s["output_throughput_tok_s"], "ttft_ms": s["ttft_ms"],
                  "itl_ms": s["itl_ms"], "e2e_ms": s["e2e_ms"], "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
                  "kv_usage_mean": s["kv_usage_mean"], "num_preemptions": s["num_preemptions"],
                  "num_rejected": s["num_rejected"], "loadavg": os.getloadavg()}
            out["points"].append(pt)
            print(json.dumps({k: pt[k] for k in ("replicas", "policy", "num_requests", "wall_s", "num_steps",
                                                 "output_throughput_tok_s", "prefix_cache_hit_rate")},
                             ) + f" ttft_p50={s['ttft_ms']['p50']} ttft_mean={s['ttft_ms']['mean']}", flush=True)
            if args.json_output:
                with open(args.json_output, "w") as f:
                    json.dump(out, f, indent=1)
    out["loadavg_end"] = os.getloadavg()
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
