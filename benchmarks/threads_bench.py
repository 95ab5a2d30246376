"""Single-stream decode with and without a busy neighbour process, per thread policy (issue 29).

Each configuration runs in a fresh process: ``LLM(model, num_threads=T)`` with
``PAGEDLLM_THREAD_POLICY`` = fixed | adaptive (and optionally ``OMP_WAIT_POLICY=PASSIVE``), greedy,
``--output-len`` tokens after a warm-up, median of ``--iters`` runs. The neighbour is one
``python -c 'while True: pass'`` process started before the engine and killed after it.

    python benchmarks/threads_bench.py --output-json benchmarks/results/threads-DATE.json

Reports tok/s per configuration, the busy/quiet ratio per policy, the CPU model and flags, and the
load average before each run (a quiet machine has < 0.5 before the quiet runs)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, statistics, sys, time
from pagedllm import LLM, SamplingParams
threads, out_len, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(sys.argv[4], num_threads=threads, max_num_seqs=4, seed=0)
sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
rates = []
for _ in range(iters):
    t = time.perf_counter()
    o = llm.generate([prompt], sp, use_tqdm=False)
    rates.append(len(o[0].outputs[0].token_ids) / (time.perf_counter() - t))
ctl = llm.llm_engine.core.executor.driver_worker.thread_controller
print("RESULT " + json.dumps({"tok_s": statistics.median(rates), "runs": rates,
                              "threads_now": ctl.threads if ctl else threads,
                              "thread_changes": ctl.changes if ctl else 0}))
"""


def cpu_info() -> dict:
    model, flags = "", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = [x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
                         if x in have]
    return {"cpu_model": model, "isa_flags": flags, "cores": os.cpu_count()}


def run(model: str, threads: int, policy: str, passive: bool, neighbour: bool, out_len: int, iters: int) -> dict:
    env = dict(os.environ, PAGEDLLM_THREAD_POLICY=policy, TOKENIZERS_PARALLELISM="false")
    env.pop("PAGEDLLM_NUM_THREADS", None)
    env.pop("OMP_NUM_THREADS", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    load = os.getloadavg()[0]
    nb = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(out_len), str(iters), model],
                           env=env, capture_output=True, text=True, timeout=900)
    finally:
        if nb is not None:
            nb.kill()
            nb.wait()
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(p.stderr[-2000:])
    r = json.loads(line[-1][7:])
    r.update(threads=threads, policy=policy + ("+PASSIVE" if passive else ""), neighbour=neighbour,
             load_avg_before=load)
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    rows = []
    configs = [("fixed", False), ("adaptive", False), ("fixed", True)]
    for neighbour in (False, True):
        for policy, passive in configs:
            rows.append(run(a.model, a.threads, policy, passive, neighbour, a.output_len, a.iters))
            time.sleep(2)
        rows.append(run(a.model, 1, "fixed", False, neighbour, a.output_len, a.iters))
    ratios = {}
    for policy in ("fixed", "adaptive", "fixed+PASSIVE"):
        q = [r for r in rows if r["policy"] == policy and not r["neighbour"] and r["threads"] == a.threads]
        b = [r for r in rows if r["policy"] == policy and r["neighbour"] and r["threads"] == a.threads]
        if q and b:
            ratios[policy] = {"quiet_tok_s": q[0]["tok_s"], "busy_tok_s": b[0]["tok_s"],
                              "busy_over_quiet": b[0]["tok_s"] / q[0]["tok_s"]}
    out = {"benchmark": "threads_bench", "date": time.strftime("%Y-%m-%d %H:%M"), **cpu_info(),
           "model": a.model, "quantization": "default (GGUF blocks kept)", "output_len": a.output_len,
           "rows": rows, "ratios": ratios}
    print(json.dumps(ratios, indent=1))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
