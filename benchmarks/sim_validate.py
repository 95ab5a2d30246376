"""Validate the fleet simulator against measured runs: the same trace through ``pagedllm serve``
(1 replica, and ``--data-parallel-size 2``) and through ``pagedllm simulate`` (the fitted step model).

    PYTHONPATH=. python benchmarks/sim_validate.py \\
        --step-model benchmarks/results/sim-step-model-DATE.json \\
        --json-output benchmarks/results/sim-validate-DATE.json

Per replica count N: a Poisson trace at ``N * --rate`` requests/s for ``--duration-s`` (prompts
``--input-len``, outputs ``--output-len`` tokens, EOS ignored) is replayed open loop
(``pagedllm simulate replay``) against a fresh server (the fit's engine settings, one thread a
replica) after one warm-up request per replica; then simulated with ``--policy least-load`` (the
server's data-parallel routing). Reported: output throughput, TTFT / ITL / E2E percentiles of
both, and simulated / measured ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(flags: list[str]) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *flags, "--port", str(port)],
                            env=env, stdout=open(f"/tmp/sim_validate_serve_{port}.log", "w"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see /tmp/sim_validate_serve_{port}.log")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    from pagedllm.sim.replay import replay
    from pagedllm.sim.simulator import ReplicaConfig, simulate
    from pagedllm.sim.step_model import StepModel
    from pagedllm.sim.trace import TraceRequest, load_trace, synthetic_trace, write_trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-model", required=True)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--rate", type=float, default=0.4, help="requests/s per replica")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--json-output", default=None)
    ap.add_argument("--trace-dir", default="/tmp", help="where the traces are written (sim-validate-trace-N.jsonl)")
    ap.add_argument("--resimulate", default=None, metavar="JSON",
                    help="keep the measurements of an earlier --json-output (and its traces in --trace-dir); "
                         "only simulate again (e.g. with a refitted --step-model)")
    args = ap.parse_args()
    model = StepModel.load(args.step_model)
    eng = model.engine
    cfg = ReplicaConfig(num_blocks=int(eng["num_blocks"]), block_size=int(eng["block_size"]),
                        max_num_seqs=int(eng["max_num_seqs"]), max_num_batched_tokens=int(eng["max_num_batched_tokens"]),
                        max_model_len=int(eng["max_model_len"]))
    flags = [args.model, "--num-threads", "1", "--kv-cache-memory", str(eng.get("kv_cache_memory", "256MiB")),
             "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
             "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    out: dict = {"cpu": model.meta.get("cpu"), "loadavg_start": os.getloadavg(), "step_model": args.step_model,
                 "args": vars(args), "runs": []}
    earlier = {}
    if args.resimulate:
        with open(args.resimulate) as f:
            prev = json.load(f)
        earlier = {r["replicas"]: r for r in prev["runs"]}
        out.update({k: prev[k] for k in ("cpu", "loadavg_start", "loadavg_end") if k in prev})
        out["measured_with"] = prev.get("args")
    for n in [int(x) for x in args.replicas.split(",")]:
        path = os.path.join(args.trace_dir, f"sim-validate-trace-{n}.jsonl")
        if n in earlier:
            trace = load_trace(path)
            meas, load0 = earlier[n]["measured"], earlier[n]["loadavg_before"]
        else:
            trace = synthetic_trace("poisson", rate=args.rate * n, duration_s=args.duration_s, seed=n,
                                    input_len=tuple(args.input_len), output_len=tuple(args.output_len))
            write_trace(path, trace)
            base, proc = _serve(flags + (["--data-parallel-size", str(n)] if n > 1 else []))
            try:
                warm = [TraceRequest(f"warm-{i}", 0.0, [300 + i] * 100, 8) for i in range(n)]
                replay(warm, base)
                load0 = os.getloadavg()
                meas = replay(trace, base)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        sim = simulate(trace, n, "least-load", model, cfg).summary
        ratio = {
            "output_throughput": sim["output_throughput_tok_s"] / meas["output_throughput_tok_s"],
            "ttft_p50": sim["ttft_ms"]["p50"] / meas["ttft_ms"]["p50"],
            "itl_p50": sim["itl_ms"]["p50"] / meas["itl_ms"]["p50"],
            "e2e_p50": sim["e2e_ms"]["p50"] / meas["e2e_ms"]["p50"]}
        run = {"replicas": n, "num_requests": len(trace), "loadavg_before": load0,
               "loadavg_after": earlier[n]["loadavg_after"] if n in earlier else os.getloadavg(),
               "measured": meas, "simulated": sim, "sim_over_measured": ratio}
        out["runs"].append(run)
        print(json.dumps({"replicas": n, "measured_tok_s": meas["output_throughput_tok_s"],
                          "sim_tok_s": sim["output_throughput_tok_s"], "measured_ttft_p50": meas["ttft_ms"]["p50"],
                          "sim_ttft_p50": sim["ttft_ms"]["p50"], "ratios": ratio}), flush=True)
    if not earlier:
        out["loadavg_end"] = os.getloadavg()
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
