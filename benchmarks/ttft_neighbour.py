"""Server TTFT and TPOT of short streamed chats, quiet and beside one busy neighbour process (issue 29).

Per thread policy (``PAGEDLLM_THREAD_POLICY`` = adaptive, the default, and fixed), one fresh
``pagedllm serve`` (the default model, default threads = all cores); then, one request at a time
(``--max-concurrency 1``), ``pagedllm bench serve --backend openai-chat`` streams
``--num-prompts`` chats of ``--input-len`` random tokens and ``--output-len`` tokens
(``ignore_eos``) with the machine quiet, and again while a neighbour process
(``python -c 'while True: pass'``, started ``--settle-s`` seconds before) spins on one core. Reports
median TTFT and TPOT of each run (each run its own random prompts, ``--seed``, so
no run reads another's prompts from the prefix cache; a first request warms the server up) and the busy / quiet ratios, with the CPU model and flags and the
load average before each run (a quiet run needs < 0.5 before it starts).

    python benchmarks/ttft_neighbour.py --output-json benchmarks/results/ttft-neighbour-DATE.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pagedllm.entrypoints.bench import machine_report  # noqa: E402


def _wait_health(url: str, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} not healthy after {timeout} s")


def _bench(port: int, args, seed: int) -> dict:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--port", str(port),
           "--backend", "openai-chat", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", "1", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--seed", str(seed), "--json-output"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"bench serve failed ({p.returncode}): {p.stdout[-3000:]} {p.stderr[-2000:]}")
    return json.loads(p.stdout[p.stdout.index("{"):])


def _bench_warm(port: int) -> None:
    subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--port", str(port),
                    "--backend", "openai-chat", "--num-prompts", "2", "--max-concurrency", "1", "--input-len", "16",
                    "--output-len", "4", "--seed", "999", "--json-output"], capture_output=True, check=True)


def _quiet(limit: float, wait_s: float) -> float:
    end = time.time() + wait_s
    while os.getloadavg()[0] >= limit and time.time() < end:
        time.sleep(5)
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="adaptive,fixed")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--settle-s", type=float, default=8.0, help="seconds between starting the neighbour and the run")
    ap.add_argument("--quiet-load", type=float, default=0.5)
    ap.add_argument("--quiet-wait-s", type=float, default=180.0)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    res: dict = {"machine": machine_report(), "args": vars(args), "runs": []}
    url = f"http://127.0.0.1:{args.port}"
    for policy in args.policies.split(","):
        env = dict(os.environ, PAGEDLLM_THREAD_POLICY=policy)
        srv = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(args.port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_health(url, 300)
            row: dict = {"policy": policy}
            _bench_warm(args.port)
            row["load_before_quiet"] = _quiet(args.quiet_load, args.quiet_wait_s)
            row["quiet"] = _bench(args.port, args, 2 * len(res["runs"]) + 1)
            row["load_before_busy"] = os.getloadavg()[0]
            nb = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(args.settle_s)
                row["busy"] = _bench(args.port, args, 2 * len(res["runs"]) + 2)
            finally:
                nb.kill()
                nb.wait()
            for k in ("median_ttft_ms", "median_tpot_ms"):
                row[k.replace("median_", "busy_over_quiet_")] = round(row["busy"][k] / row["quiet"][k], 3)
            print(json.dumps({"policy": policy, "quiet_ttft_ms": row["quiet"]["median_ttft_ms"],
                              "busy_ttft_ms": row["busy"]["median_ttft_ms"],
                              "quiet_tpot_ms": row["quiet"]["median_tpot_ms"],
                              "busy_tpot_ms": row["busy"]["median_tpot_ms"],
                              "ttft_ratio": row["busy_over_quiet_ttft_ms"], "tpot_ratio": row["busy_over_quiet_tpot_ms"],
                              "load_before_quiet": row["load_before_quiet"]}), flush=True)
            res["runs"].append(row)
        finally:
            srv.terminate()
            srv.wait(timeout=60)
        time.sleep(5)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
