"""Resident memory of ``pagedllm serve`` (issue 30): idle after start, after a mixed burst, after
the idle release.

Starts ``python -m pagedllm.entrypoints.cli serve [FLAGS] --port P`` (default flags: the embedded
SmolLM2-135M-Instruct Q4_1 GGUF), then reads the server's resident memory at four points:

  start       5 s after /health first answers
  burst       right after 32 mixed /v1/completions requests (8 at a time): 28 short prompts of
              3-40 words with 8-64 output tokens (greedy and sampled), and 4 prompts of ~2,500
              words (~3,300 tokens) with 16 output tokens
  fill        with ``--fill``: rounds of 8 further ~2,500-word prompts (new words each round) until
              the committed KV reaches 95% of the reserved cache (at most 6 rounds), so the burst
              fills the KV cache (use a bounded ``--kv-cache-memory``)
  idle        ``--idle-wait`` seconds later (the server's idle release runs after
              PAGEDLLM_IDLE_RELEASE_S, default 10 s); ``--idle-samples 12,30`` also reads at
              those seconds after the burst
  peak        VmHWM

Resident figures come from ``/proc/<pid>/status`` (VmRSS, VmHWM; proc(5)), in MiB, and the KV
figures from the server's own ``/metrics`` (``pagedllm:kv_cache_bytes``, and
``pagedllm:kv_cache_committed_bytes`` where the server has it).

    python benchmarks/memory_lazykv.py [--json out.json] [--label NAME] [--idle-wait S]
        [--idle-samples S1,S2] [--fill] [-- serve flags...]

RSS figures do not depend on the machine's load; nothing here is a timing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_helpers import free_port  # noqa: E402

from pagedllm.metrics.memory import smaps_breakdown  # noqa: E402

MiB = 1 << 20


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` / ``VmHWM`` / ``RssAnon`` of ``pid`` in bytes (``/proc/<pid>/status``, proc(5))."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def smaps_rollup(pid: int) -> dict[str, float]:
    """File-backed vs anonymous resident pages of ``pid`` in MiB (``/proc/<pid>/smaps_rollup``, proc(5)):
    ``file_clean_mib`` (Shared_Clean + Private_Clean: mapped file pages the kernel may drop and read back,
    e.g. mmapped weights), ``anon_mib`` (Anonymous)."""
    vals = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if v.strip().endswith("kB"):
                    vals[k] = int(v.split()[0]) * 1024
    except OSError:
        return {}
    return {"file_clean_mib": round((vals.get("Shared_Clean", 0) + vals.get("Private_Clean", 0)) / MiB, 1),
            "anon_mib": round(vals.get("Anonymous", 0) / MiB, 1)}


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^pagedllm:{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


def snapshot(pid: int, base: str) -> dict:
    st = proc_status(pid)
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {"rss_mib": round(st["VmRSS"] / MiB, 1), "rss_anon_mib": round(st.get("RssAnon", 0) / MiB, 1),
           "peak_rss_mib": round(st["VmHWM"] / MiB, 1)}
    out.update(smaps_rollup(pid))
    out["smaps_mib"] = {k: round(v / MiB, 1) for k, v in smaps_breakdown(pid).items()}
    for name in ("kv_cache_bytes", "kv_cache_committed_bytes", "weight_bytes", "cpu_allocator_cached_bytes",
                 "weight_file_bytes", "weight_mapped_bytes"):
        v = metric(text, name)
        if v is not None:
            out[name.replace("_bytes", "_mib")] = round(v / MiB, 1)
    return out


def requests_32(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ("river mountain garden music story city light water history science market bridge "
             "winter forest ocean library engine signal harvest").split()
    reqs = []
    for i in range(32):
        if i % 8 == 3:  # 4 long prompts
            prompt = " ".join(rng.choice(words) for _ in range(2500))
            reqs.append({"prompt": prompt, "max_tokens": 16, "temperature": 0})
        else:
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
            reqs.append({"prompt": prompt, "max_tokens": rng.choice([8, 16, 32, 64]),
                         "temperature": rng.choice([0, 0.8]), "seed": i})
    return reqs


def long_requests(seed: int, n: int = 8) -> list[dict]:
    """``n`` prompts of ~2,500 random words (16 greedy output tokens each), distinct per ``seed``."""
    rng = random.Random(1000 + seed)
    words = ("river mountain garden music story city light water history science market bridge "
             "winter forest ocean library engine signal harvest pepper violin orbit castle meadow").split()
    return [{"prompt": " ".join(rng.choice(words) for _ in range(2500)), "max_tokens": 16, "temperature": 0}
            for _ in range(n)]


async def burst(base: str, reqs: list[dict], concurrency: int = 8) -> int:
    sem = asyncio.Semaphore(concurrency)
    ok = 0
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(body):
            nonlocal ok
            async with sem:
                r = await c.post(base + "/v1/completions", json={"model": model_name(base), **body})
                r.raise_for_status()
                ok += 1
        await asyncio.gather(*(one(b) for b in reqs))
    return ok


def model_name(base: str, _cache: dict = {}) -> str:
    if base not in _cache:
        _cache[base] = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    return _cache[base]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--label", default="run")
    ap.add_argument("--idle-wait", type=float, default=16.0)
    ap.add_argument("--idle-samples", default="", help="comma-separated seconds after the burst to read too")
    ap.add_argument("--fill", action="store_true", help="keep sending long prompts until the KV cache is full")
    ap.add_argument("flags", nargs="*")
    a = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *a.flags, "--port", str(port)]
    log = open(f"/tmp/memory_lazykv_{a.label}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(open(log.name).read())
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        time.sleep(5)
        res = {"label": a.label, "command": " ".join(["pagedllm", "serve", *a.flags]), "start": snapshot(proc.pid, base)}
        n = asyncio.run(burst(base, requests_32()))
        res["requests_ok"] = n
        res["after_32_requests"] = snapshot(proc.pid, base)
        if a.fill:
            rounds = 0
            while rounds < 6:
                snap = res["after_32_requests"] if rounds == 0 else res["after_fill"]
                if snap.get("kv_cache_committed_mib", 0) >= 0.95 * snap.get("kv_cache_mib", 0):
                    break
                rounds += 1
                res["requests_ok"] += asyncio.run(burst(base, long_requests(rounds)))
                res["after_fill"] = snapshot(proc.pid, base)
            res["fill_rounds"] = rounds
        t_burst = time.time()
        for s in sorted(float(x) for x in a.idle_samples.split(",") if x.strip()):
            if s < a.idle_wait:
                time.sleep(max(0.0, t_burst + s - time.time()))
                res[f"idle_{s:g}s"] = snapshot(proc.pid, base)
        time.sleep(max(0.0, t_burst + a.idle_wait - time.time()))
        res["after_idle_release"] = snapshot(proc.pid, base)
        plan = [ln.strip() for ln in open(log.name)
                if "memory plan" in ln or "KV cache budget" in ln or "loaded in" in ln or "weights" in ln]
        res["startup_log"] = plan[:6]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
