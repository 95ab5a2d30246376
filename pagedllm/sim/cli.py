"""``pagedllm simulate`` (run the fleet simulator), ``pagedllm simulate fit`` (fit the step-time model
on this machine) and ``pagedllm simulate replay`` (send a trace to a running server and measure).

A user mistake (bad trace, bad flag value) is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from pagedllm.entrypoints.cli_utils import positive_int
from pagedllm.entrypoints.openai.cli_args import positive_float
from pagedllm.router.policy import POLICIES
from pagedllm.sim.trace import SYNTHETIC_KINDS

#: The step model fitted on the development machine, used when ``--step-model`` is not given.
DEFAULT_STEP_MODEL = os.path.join(os.path.dirname(__file__), "step_model_default.json")


_pos_int = positive_int  # (pagedllm.entrypoints.cli_utils)


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Workload (one of --trace / --synthetic)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, metavar="FILE",
                     help="JSONL trace: one {arrival_s, prompt_token_ids | prefix_id+prefix_len+prompt_len, "
                          "max_tokens, conversation_id} a line (pagedllm/sim/trace.py).")
    src.add_argument("--synthetic", default=None, choices=list(SYNTHETIC_KINDS),
                     help="A generated trace: Poisson arrivals, bursty (gamma, --burstiness), multi-turn chat "
                          "with shared system prompts (--num-turns a conversation), long shared documents.")
    g.add_argument("--request-rate", type=positive_float, default=None,
                   help="Synthetic: requests per second, whole fleet (default: --request-rate-per-replica x "
                        "--replicas).")
    g.add_argument("--request-rate-per-replica", type=positive_float, default=0.2,
                   help="Synthetic: requests per second per replica when --request-rate is not given.")
    g.add_argument("--duration-s", type=positive_float, default=None,
                   help="Synthetic: arrivals over this many seconds (default 60); trace: drop arrivals "
                        "after it (default: keep all).")
    g.add_argument("--seed", type=int, default=0, help="Seeds the generator and the prefix-cache root hash.")
    g.add_argument("--input-len", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"),
                   help="Synthetic poisson/bursty: prompt tokens, uniform.")
    g.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"),
                   help="Synthetic: generated tokens (max_tokens), uniform.")
    g.add_argument("--num-turns", type=_pos_int, default=8, help="Synthetic multi-turn: turns a conversation.")
    g.add_argument("--num-system-prompts", type=_pos_int, default=4,
                   help="Synthetic multi-turn: distinct shared system prompts.")
    g.add_argument("--system-prompt-len", type=int, default=256, help="Synthetic multi-turn: tokens of each.")
    g.add_argument("--think-time-s", type=positive_float, default=20.0,
                   help="Synthetic multi-turn: mean seconds between a conversation's turns (exponential).")
    g.add_argument("--burstiness", type=positive_float, default=0.25,
                   help="Synthetic bursty: gamma shape of the inter-arrival times (1 = Poisson).")
    g.add_argument("--save-trace", default=None, metavar="FILE",
                   help="Write the trace used (token ids spelled out) as JSONL, e.g. for `simulate replay`.")


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``pagedllm simulate``."""
    _add_trace_args(p)
    g = p.add_argument_group("Fleet")
    g.add_argument("--replicas", type=_pos_int, default=1, help="Engine replicas behind the router.")
    g.add_argument("--policy", default="least-load", choices=list(POLICIES),
                   help="Routing policy (pagedllm/sim/simulator.py).")
    g.add_argument("--balance-abs-threshold", type=int, default=8,
                   help="prefix: go least-load when the prefix replica has this many more requests in flight "
                        "than the least loaded one (sgl-router's name).")
    g.add_argument("--router-rules", action="store_true",
                   help="Route with `pagedllm router`'s own policy and its defaults (pagedllm/router/policy.py: "
                        "prefix's cost rule, least-load's ties in turn) instead of the simulator's rules; "
                        "O(replicas) a request.")
    g.add_argument("--closed-loop", action="store_true",
                   help="Send a conversation's later turns think_time_s (else their arrival gap) after its "
                        "previous turn finished, as a chat client does.")
    g.add_argument("--step-model", default=None, metavar="FILE",
                   help="Step-time model JSON (`pagedllm simulate fit --output`); default: the one fitted on "
                        "the development machine (pagedllm/sim/step_model_default.json).")
    e = p.add_argument_group("Replica engine (default: the step model's fit settings, else EngineArgs')")
    e.add_argument("--num-blocks", type=_pos_int, default=None, help="KV cache blocks a replica (incl. block 0).")
    e.add_argument("--block-size", type=_pos_int, default=None, help="Tokens per KV block (16).")
    e.add_argument("--max-num-seqs", type=_pos_int, default=None, help="Requests a step (128).")
    e.add_argument("--max-num-batched-tokens", type=_pos_int, default=None, help="Token budget a step (2048).")
    e.add_argument("--max-model-len", type=_pos_int, default=None, help="Tokens a request (8192).")
    e.add_argument("--long-prefill-token-threshold", type=int, default=0, help="Chunk cap per request a step.")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="Prefix caching in every replica.")
    o = p.add_argument_group("Output")
    o.add_argument("--output-json", default=None, metavar="FILE",
                   help="Write {summary, replicas} as JSON ('-': stdout).")
    o.add_argument("--no-per-replica", action="store_true", help="Leave the per-replica figures out.")
    o.add_argument("--no-fast-forward", action="store_true",
                   help="Call the scheduler for every step, also in runs of pure-decode steps (same result, slower).")


def add_fit_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``pagedllm simulate fit``."""
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="Model to time (as `pagedllm serve`).")
    p.add_argument("--num-threads", type=_pos_int, default=1, help="Torch threads.")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache size (as `pagedllm serve`).")
    p.add_argument("--max-num-seqs", type=_pos_int, default=128, help="Engine max_num_seqs.")
    p.add_argument("--max-num-batched-tokens", type=_pos_int, default=2048, help="Engine token budget.")
    p.add_argument("--max-model-len", type=_pos_int, default=4096, help="Engine max_model_len.")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="Decode batch sizes of the grid.")
    p.add_argument("--contexts", default="64,512,1536", help="Context lengths of the grid (tokens).")
    p.add_argument("--prefills", default="32,128,512,1024,2048", help="Single-prompt lengths of the grid.")
    p.add_argument("--max-grid-tokens", type=_pos_int, default=8192,
                   help="Skip grid points whose rows x context exceeds this.")
    p.add_argument("--repeats", type=_pos_int, default=2, help="Passes over the grid (first: warm-up too).")
    p.add_argument("--output", default=None, metavar="FILE", help="Write the step-model JSON here.")
    p.add_argument("--from-samples", default=None, metavar="FILE",
                   help="Refit from the measured steps ('meta.samples') of an earlier fit's JSON; runs no engine.")


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``pagedllm simulate replay``."""
    _add_trace_args(p)
    p.add_argument("--replicas", type=_pos_int, default=1,
                   help="Synthetic: scales the default rate (as for `simulate`).")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server to send the trace to.")
    p.add_argument("--model", default=None, help="The request's model field (default: the server's first).")
    p.add_argument("--timeout-s", type=positive_float, default=600.0, help="Per-request timeout.")
    p.add_argument("--output-json", default=None, metavar="FILE", help="Write the measurement as JSON.")


def load_workload(args: argparse.Namespace, prog: str) -> list:
    """The trace of ``--trace`` / ``--synthetic`` (ValueError: bad file or settings)."""
    from pagedllm.sim.trace import load_trace, synthetic_trace, write_trace

    if args.trace is None and args.synthetic is None:
        raise ValueError("one of --trace FILE or --synthetic KIND is required")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if lo < 1 or hi < lo:
            raise ValueError(f"--{name.replace('_', '-')}: expected 1 <= MIN <= MAX, got {lo} {hi}")
    if args.trace is not None:
        trace = load_trace(args.trace)
        if args.duration_s is not None:
            trace = [r for r in trace if r.arrival_s < args.duration_s]
            if not trace:
                raise ValueError(f"--duration-s {args.duration_s}: no request of {args.trace} arrives before it")
    else:
        rate = args.request_rate or args.request_rate_per_replica * args.replicas
        trace = synthetic_trace(
            args.synthetic, rate=rate, duration_s=args.duration_s or 60.0, seed=args.seed,
            input_len=tuple(args.input_len), output_len=tuple(args.output_len), num_turns=args.num_turns,
            num_system_prompts=args.num_system_prompts, system_prompt_len=args.system_prompt_len,
            think_time_s=args.think_time_s, burstiness=args.burstiness)
        if not trace:
            raise ValueError("--synthetic: no request arrives in --duration-s at this --request-rate")
    if args.save_trace:
        write_trace(args.save_trace, trace)
    return trace


def _fmt(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items() if k in ("mean", "p50", "p90", "p99"))


def run_simulate(args: argparse.Namespace) -> int:
    """``pagedllm simulate``: print the summary (and write ``--output-json``)."""
    from pagedllm.router.policy import PolicyConfig
    from pagedllm.sim.simulator import ReplicaConfig, simulate
    from pagedllm.sim.step_model import StepModel

    trace = load_workload(args, "pagedllm simulate")
    model = StepModel.load(args.step_model or DEFAULT_STEP_MODEL)
    eng = model.engine
    cfg = ReplicaConfig(
        num_blocks=args.num_blocks or int(eng.get("num_blocks", 4096)),
        block_size=args.block_size or int(eng.get("block_size", 16)),
        max_num_seqs=args.max_num_seqs or int(eng.get("max_num_seqs", 128)),
        max_num_batched_tokens=args.max_num_batched_tokens or int(eng.get("max_num_batched_tokens", 2048)),
        max_model_len=args.max_model_len or int(eng.get("max_model_len", 8192)),
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold)
    res = simulate(trace, args.replicas, args.policy, model, cfg, seed=args.seed,
                   balance_abs_threshold=args.balance_abs_threshold, per_replica=not args.no_per_replica,
                   closed_loop=args.closed_loop, router_rules=PolicyConfig() if args.router_rules else None,
                   fast_forward=not args.no_fast_forward)
    s = res.summary
    print(f"replicas={s['num_replicas']} policy={s['policy']} requests={s['num_completed']}/{s['num_requests']} "
          f"(rejected {s['num_rejected']}) simulated={s['simulated_s']:.1f}s wall={s['wall_s']:.2f}s "
          f"steps={s['num_steps']}")
    print(f"output throughput {s['output_throughput_tok_s']:.1f} tok/s, {s['request_throughput_req_s']:.3f} req/s")
    print(f"TTFT ms: {_fmt(s['ttft_ms'])}")
    print(f"ITL ms:  {_fmt(s['itl_ms'])}")
    print(f"E2E ms:  {_fmt(s['e2e_ms'])}")
    print(f"prefix cache hit rate {s['prefix_cache_hit_rate']:.3f}; KV usage mean {s['kv_usage_mean']:.3f} "
          f"peak {s['kv_usage_peak']:.3f}; preemptions {s['num_preemptions']}")
    if res.replicas and len(res.replicas) <= 16:
        for r in res.replicas:
            print(f"  replica {r['replica']}: requests {r['num_requests']} busy {r['busy_fraction']:.2f} "
                  f"TTFT p50 {r['ttft_ms']['p50']} ms hit {r['prefix_cache_hit_rate']:.3f} "
                  f"KV mean {r['kv_usage_mean']:.3f} peak {r['kv_usage_peak']:.3f}")
    _write_json(args.output_json, res.to_json())
    return 0


def _write_json(path: Optional[str], obj: Any) -> None:
    if not path:
        return
    if path == "-":
        json.dump(obj, sys.stdout, indent=1)
        print()
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def run_fit(args: argparse.Namespace) -> int:
    """``pagedllm simulate fit``."""
    from pagedllm.sim.fit import fit_on_engine
    from pagedllm.sim.step_model import StepModel, fit_step_model

    if args.from_samples:
        old = StepModel.load(args.from_samples)
        samples = old.meta.get("samples")
        if not isinstance(samples, list) or not all(isinstance(x, list) and len(x) == 5 for x in samples):
            raise ValueError(f"--from-samples {args.from_samples}: meta.samples: expected a list of "
                             "[prefill_tokens, decode_rows, decode_context_k, prefill_attention_kpairs, seconds]")
        meta = {k: v for k, v in old.meta.items() if k != "fit"}
        model = fit_step_model([tuple(x) for x in samples], engine=old.engine, meta=meta)
    else:
        model = fit_on_engine(args)
    m = model.to_json()
    from pagedllm.sim.step_model import COEFFICIENTS
    print(json.dumps({k: m[k] for k in COEFFICIENTS}))
    print(json.dumps(m["meta"].get("fit", {})))
    _write_json(args.output, m)
    return 0


def run_replay(args: argparse.Namespace) -> int:
    """``pagedllm simulate replay``."""
    from pagedllm.sim.replay import replay

    trace = load_workload(args, "pagedllm simulate replay")
    res = replay(trace, args.base_url, model=args.model, timeout_s=args.timeout_s)
    s = res
    print(f"requests={s['num_completed']}/{s['num_requests']} (failed {s['num_failed']}) duration={s['duration_s']:.1f}s")
    print(f"output throughput {s['output_throughput_tok_s']:.1f} tok/s")
    print(f"TTFT ms: {_fmt(s['ttft_ms'])}")
    print(f"ITL ms:  {_fmt(s['itl_ms'])}")
    print(f"E2E ms:  {_fmt(s['e2e_ms'])}")
    _write_json(args.output_json, res)
    return 0 if not s["num_failed"] else 1
