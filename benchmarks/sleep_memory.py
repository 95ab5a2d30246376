"""Resident memory of ``pagedllm serve --enable-sleep-mode`` (default model and flags) before a sleep,
asleep (levels 1 and 2) and after each wake, read from /proc/PID/status (VmRSS, RssAnon), with
greedy outputs compared before and after each wake (issue 37.6).

    python benchmarks/sleep_memory.py [--out benchmarks/results/sleep-memory-DATE.json] [-- extra serve flags]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import httpx  # noqa: E402

from server_helpers import serve  # noqa: E402

PROMPTS = ["The capital of France is", "Write one sentence about the sea.",
           " ".join(["Once upon a time there was a small village by the river."] * 40)]


def status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


def run(base: str) -> list[str]:
    texts = []
    for p in PROMPTS:
        r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0},
                       timeout=300)
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait before each reading")
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    rows = []
    with serve(["SmolLM2-135M-Instruct", "--enable-sleep-mode", *a.serve_args]) as (base, proc):
        def mark(name: str) -> None:
            time.sleep(a.settle)
            s = status(proc.pid)
            rows.append({"state": name, **s})
            print(f"{name:28s} VmRSS {s['VmRSS'] / 2**20:8.1f} MiB  RssAnon {s['RssAnon'] / 2**20:8.1f} MiB  "
                  f"RssFile {s['RssFile'] / 2**20:7.1f} MiB", flush=True)

        mark("idle after start")
        ref = run(base)
        mark("after requests")
        same = {}
        for level in (1, 2):
            t0 = time.perf_counter()
            httpx.post(base + f"/sleep?level={level}", timeout=300).raise_for_status()
            t_sleep = time.perf_counter() - t0
            assert httpx.get(base + "/is_sleeping").json() == {"is_sleeping": True}
            code = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
            mark(f"asleep (level {level})")
            t0 = time.perf_counter()
            httpx.post(base + "/wake_up", timeout=300).raise_for_status()
            t_wake = time.perf_counter() - t0
            mark(f"after wake (level {level})")
            out = run(base)
            same[level] = out == ref
            mark(f"after requests (level {level})")
            rows[-3]["sleep_s"], rows[-2]["wake_s"], rows[-3]["status_while_asleep"] = t_sleep, t_wake, code
            print(f"level {level}: sleep {t_sleep:.2f} s, wake {t_wake:.2f} s, completion while asleep -> "
                  f"{code}, outputs after wake identical: {same[level]}", flush=True)
    res = {"rows": rows, "identical_after_wake": same, "load": open("/proc/loadavg").read().split()[:3],
           "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")}
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
