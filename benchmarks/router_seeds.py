"""Why the prefix / least-load hit-rate ratio of the router benchmark moves between runs: the
benchmark's own workload, simulated closed loop with the server router's policy, over seeds of the
clients' think times and over KV cache sizes.

    PYTHONPATH=. python benchmarks/router_seeds.py \\
        --trace benchmarks/results/router-chat-trace-2026-12-01-16conv.jsonl --seeds 20 \\
        --num-blocks 330,361,400,450,600 --tie-breaks turn,first,random --round-robin \\
        --json-output benchmarks/results/router-seeds-DATE.json

The trace is a recorded ``benchmarks/router_bench.py --save-trace`` run (16 conversations, a shared
system prompt, 8 turns each, the replica's token ids and replies). Each conversation is replayed as
the benchmark's client sends it: a think time (exponential, mean ``--think-time-s``) before every
turn, counted from the end of the previous reply (``simulate(closed_loop=True)``). Seed 0 draws the
benchmark's own think times (``random.Random(conversation)``, as ``router_bench.run_trace``); seed
s > 0 draws others. Routing is ``pagedllm.router.policy.Router`` (``router_rules``): the prefix
policy's cost rule with the router's defaults, least-load's ties in turn. The replicas are
``router_bench``'s (``--max-num-seqs 16 --max-model-len 2048``, ``--num-blocks`` a replica) with
the default step model.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from dataclasses import replace


def think_trace(trace: list, seed: int, think_s: float) -> list:
    """``trace`` with each conversation's think times drawn for ``seed`` (module docstring)."""
    by_conv: dict[str, list] = {}
    for r in trace:
        by_conv.setdefault(r.conversation_id, []).append(r)
    out = []
    for cid, turns in by_conv.items():
        c = int(cid.rsplit("-", 1)[1])
        rng = random.Random(c) if seed == 0 else random.Random(f"router-seeds:{seed}:{c}")
        turns.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
        for k, r in enumerate(turns):
            think = rng.expovariate(1.0 / think_s)
            # (turn 0: sent at its think time; later turns: that long after the previous reply)
            out.append(replace(r, arrival_s=think if k == 0 else turns[0].arrival_s + k * 1e-6,
                               think_time_s=None if k == 0 else think))
    out.sort(key=lambda r: r.arrival_s)
    return out


def main() -> None:
    from pagedllm.router.policy import PolicyConfig
    from pagedllm.sim.simulator import ReplicaConfig, simulate
    from pagedllm.sim.step_model import StepModel
    from pagedllm.sim.trace import load_trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--step-model", default="pagedllm/sim/step_model_default.json")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--num-blocks", default="361")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--think-time-s", type=float, default=1.0)
    ap.add_argument("--tie-breaks", default="turn",
                    help="least-load's tie breaks to compare (PolicyConfig.tie_break: turn,first,random); "
                         "the ratio is against each; random is seeded by the seed")
    ap.add_argument("--round-robin", action="store_true",
                    help="also run round-robin (no load feedback: a later turn finds its replica half the time)")
    ap.add_argument("--json-output", default=None)
    a = ap.parse_args()
    model = StepModel.load(a.step_model)
    base = load_trace(a.trace)
    out: dict = {"args": vars(a), "loadavg_start": os.getloadavg(), "points": []}
    for nb in [int(x) for x in a.num_blocks.split(",")]:
        cfg = ReplicaConfig(num_blocks=nb, block_size=16, max_num_seqs=16, max_num_batched_tokens=2048,
                            max_model_len=2048)
        tbs = a.tie_breaks.split(",")
        ratios, ttft_ratios = [], []
        rr_ratios: list = []
        rr_same: list = []
        by_tb: dict = {tb: [] for tb in tbs}
        same_tb: dict = {tb: [] for tb in tbs}
        for seed in range(a.seeds):
            tr = think_trace(base, seed, a.think_time_s)
            pt: dict = {"num_blocks": nb, "seed": seed}
            runs = [("least-load" if tb == tbs[0] else f"least-load/{tb}", "least-load", tb) for tb in tbs]
            extra = [("round-robin", "round-robin", "turn")] if a.round_robin else []
            for name, pol, tb in runs + extra + [("prefix", "prefix", "turn")]:
                s = simulate(tr, a.replicas, pol, model, cfg, closed_loop=True,
                             router_rules=PolicyConfig(tie_break=tb, tie_seed=seed), per_replica=False).summary
                pt[name] = {"hit_rate": s["prefix_cache_hit_rate"], "mean_ttft_ms": s["ttft_ms"]["mean"],
                           "p50_ttft_ms": s["ttft_ms"]["p50"], "preemptions": s["num_preemptions"],
                           "prefix_routed": s["prefix_routed"], "num_completed": s["num_completed"],
                           "simulated_s": s["simulated_s"],
                           "same_replica_as_previous_turn": s["same_replica_as_previous_turn"]}
            if a.round_robin:
                rr_ratios.append(pt["prefix"]["hit_rate"] / max(pt["round-robin"]["hit_rate"], 1e-9))
                rr_same.append(pt["round-robin"]["same_replica_as_previous_turn"])
            for name, _, tb in runs:
                by_tb[tb].append(pt["prefix"]["hit_rate"] / max(pt[name]["hit_rate"], 1e-9))
                same_tb[tb].append(pt[name]["same_replica_as_previous_turn"])
            pt["hit_rate_ratio"] = pt["prefix"]["hit_rate"] / max(pt["least-load"]["hit_rate"], 1e-9)
            pt["mean_ttft_ratio"] = pt["prefix"]["mean_ttft_ms"] / pt["least-load"]["mean_ttft_ms"]
            ratios.append(pt["hit_rate_ratio"])
            ttft_ratios.append(pt["mean_ttft_ratio"])
            out["points"].append(pt)
            print(json.dumps({"num_blocks": nb, "seed": seed, "least_load_hit": round(pt["least-load"]["hit_rate"], 3),
                              "prefix_hit": round(pt["prefix"]["hit_rate"], 3),
                              "hit_ratio": round(pt["hit_rate_ratio"], 3),
                              "least_load_same_replica": round(pt["least-load"]["same_replica_as_previous_turn"], 3),
                              "ttft_ratio": round(pt["mean_ttft_ratio"], 3),
                              **{f"hit_ratio_{tb}": round(by_tb[tb][-1], 3) for tb in tbs}}), flush=True)
        q = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else ratios * 9
        summ = {"num_blocks": nb, "seeds": a.seeds, "hit_ratio_min": min(ratios), "hit_ratio_p10": q[0],
                "hit_ratio_median": statistics.median(ratios), "hit_ratio_p90": q[-1], "hit_ratio_max": max(ratios),
                "share_at_least_1_5": sum(r >= 1.5 for r in ratios) / len(ratios),
                "ttft_ratio_median": statistics.median(ttft_ratios), "ttft_ratio_max": max(ttft_ratios),
                "by_tie_break": {tb: {"hit_ratio_min": min(v), "hit_ratio_median": statistics.median(v),
                                      "hit_ratio_max": max(v), "share_at_least_1_5": sum(r >= 1.5 for r in v) / len(v),
                                      "same_replica_median": statistics.median(same_tb[tb])}
                                 for tb, v in by_tb.items()}}
        if rr_ratios:
            summ["round_robin"] = {"hit_ratio_min": min(rr_ratios), "hit_ratio_median": statistics.median(rr_ratios),
                                   "hit_ratio_max": max(rr_ratios),
                                   "share_at_least_1_5": sum(r >= 1.5 for r in rr_ratios) / len(rr_ratios),
                                   "same_replica_median": statistics.median(rr_same)}
        out.setdefault("summary", []).append(summ)
        print(json.dumps(summ), flush=True)
    out["loadavg_end"] = os.getloadavg()
    if a.json_output:
        with open(a.json_output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
