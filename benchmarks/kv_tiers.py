"""KV cache tiers (issue 33): what the OffloadingConnector buys, in one run each.

``restart-ttft``: time to first token of a request with a ``--prefix-len``-token prompt (a shared
system prompt / document) on a freshly started server, four ways, each on its own server
process started for the measurement (a warm-up request with unrelated tokens goes first, so
the measured one pays no first-forward costs):

* ``cold``: no connector: the whole prompt is prefilled;
* ``disk-restart``: ``--kv-cache-dir D`` on a server started after another server (now stopped)
  answered the same prompt: its blocks come from D;
* ``device-hit`` (reference): the same server answers the prompt a second time (device prefix
  cache), i.e. "cache-hit speed".

The ratio of interest is ``disk-restart / cold`` (target <= 0.2).

``multiturn``: offline throughput (``LLM.generate``) of multi-turn chats whose live prefixes are
``--pool-multiple`` times the KV pool: ``--conversations`` chats, each starting from its own
``--prefix-len``-token history; every turn appends ``--turn-len`` new user tokens to each chat,
generates ``--output-len`` tokens, and appends them to its history. The chats of a turn go in one
``generate`` call (so the pool churns through all of them before a chat comes back), host tier
off vs on (``kv_offloading_size``). Throughput = (prompt + generated tokens) / wall seconds.

    python benchmarks/kv_tiers.py restart-ttft --json-output r.json
    python benchmarks/kv_tiers.py multiturn --json-output m.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``pagedllm serve`` in a subprocess (stopped with SIGTERM: a graceful shutdown)."""

    def __init__(self, args: list[str], threads: int) -> None:
        import httpx

        self.port = _port()
        env = dict(os.environ, PAGEDLLM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args,
                                      "--port", str(self.port), "--served-model-name", "m"],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode})")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.proc.kill()
                raise RuntimeError("server did not start")
            time.sleep(0.2)

    def ttft(self, prompt: list[int], max_tokens: int = 4) -> float:
        """Seconds from sending a streaming completion to its first token."""
        import httpx

        t0 = time.perf_counter()
        with httpx.stream("POST", self.base + "/v1/completions", timeout=600,
                          json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as r:
            t = None
            for line in r.iter_lines():
                if t is None and line.startswith("data: ") and line != "data: [DONE]":
                    t = time.perf_counter() - t0
        if t is None:
            raise RuntimeError("no token")
        return t

    def metric(self, name: str) -> float:
        import httpx

        text = httpx.get(self.base + "/metrics").text
        return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _machine() -> dict:
    flags = ""
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                f = set(line.split(":", 1)[1].split())
                flags = " ".join(x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if x in f)
    except OSError:
        pass
    return {"cpu": model, "flags": flags, "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}


def restart_ttft(a: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(a.prefix_len)]
    warm = [rng.randrange(1000, 40000) for _ in range(32)]
    common = [a.model, "--max-num-batched-tokens", "2048", "--kv-cache-memory", "512MiB"]
    d = tempfile.mkdtemp(prefix="kvtier-bench-")
    out: dict = {"prefix_len": a.prefix_len, "repeats": a.repeats, "runs": []}
    try:
        for rep in range(a.repeats):
            shutil.rmtree(d, ignore_errors=True)
            row = {}
            s = Server(common, a.threads)  # cold, and the device-hit reference
            s.ttft(warm)
            row["cold"] = s.ttft(prompt)
            row["device-hit"] = s.ttft(prompt)
            s.stop()
            s = Server(common + ["--kv-cache-dir", d], a.threads)  # fills the disk tier
            s.ttft(warm)
            row["disk-first-server"] = s.ttft(prompt)
            s.stop()
            s = Server(common + ["--kv-cache-dir", d], a.threads)  # the restart
            s.ttft(warm)
            row["disk-restart"] = s.ttft(prompt)
            row["disk_hit_tokens"] = s.metric("pagedllm:kv_tier_hit_tokens_total")
            row["disk_load_seconds"] = s.metric("pagedllm:kv_tier_load_seconds_total")
            s.stop()
            out["runs"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for k in ("cold", "device-hit", "disk-first-server", "disk-restart"):
        out[k + "_median_s"] = statistics.median(r[k] for r in out["runs"])
    out["disk_restart_over_cold"] = out["disk-restart_median_s"] / out["cold_median_s"]
    out["disk_restart_over_device_hit"] = out["disk-restart_median_s"] / out["device-hit_median_s"]
    return out


def multiturn(a: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams

    os.environ["PAGEDLLM_NUM_THREADS"] = str(a.threads)
    rng = random.Random(1)
    pool_tokens = a.conversations * a.prefix_len // a.pool_multiple
    out: dict = {"conversations": a.conversations, "prefix_len": a.prefix_len, "turns": a.turns,
                 "turn_len": a.turn_len, "output_len": a.output_len, "pool_tokens": pool_tokens, "modes": {}}
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    for mode, kw in (("host-off", {}), ("host-on", {"kv_offloading_size": a.offloading_gib})):
        # the pool: pool_tokens worth of KV (bytes per token from a probe engine)
        if "bpt" not in out:
            probe = LLM(a.model, kv_cache_memory="64MiB", max_model_len=512)
            out["kv_bytes_per_token"] = probe.llm_engine.core.kv_block_bytes // probe.llm_engine.core.block_size
            probe.llm_engine.core.shutdown()
            out["bpt"] = True
        llm = LLM(a.model, max_num_batched_tokens=2048, max_num_seqs=a.max_num_seqs, seed=0,
                  kv_cache_memory=(pool_tokens // 16 + 1) * 16 * out["kv_bytes_per_token"], **kw)
        r2 = random.Random(2)
        hist = [[r2.randrange(1000, 40000) for _ in range(a.prefix_len)] for _ in range(a.conversations)]
        tokens = 0
        t0 = time.perf_counter()
        for turn in range(a.turns):
            prompts = []
            for h in hist:
                h.extend(r2.randrange(1000, 40000) for _ in range(a.turn_len))
                prompts.append({"prompt_token_ids": list(h)})
            outs = llm.generate(prompts, sp, use_tqdm=False)
            for h, o in zip(hist, outs):
                h.extend(o.outputs[0].token_ids)
                tokens += len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
        secs = time.perf_counter() - t0
        core = llm.llm_engine.core
        st = core.get_scheduler_stats()
        out["modes"][mode] = {"seconds": secs, "tokens_per_s": tokens / secs, "tokens": tokens,
                              "prefix_cache_hits": st["prefix_cache_hits"], "kv_connector": st.get("kv_connector"),
                              "num_blocks": core.num_blocks}
        print(mode, json.dumps({k: v for k, v in out["modes"][mode].items() if k != "kv_connector"}), flush=True)
        core.shutdown()
        del llm
    out.pop("bpt", None)
    out["host_on_over_off"] = out["modes"]["host-on"]["tokens_per_s"] / out["modes"]["host-off"]["tokens_per_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restart-ttft")
    r.add_argument("--prefix-len", type=int, default=2000)
    r.add_argument("--repeats", type=int, default=3)
    m = sub.add_parser("multiturn")
    m.add_argument("--conversations", type=int, default=16)
    m.add_argument("--prefix-len", type=int, default=1000)
    m.add_argument("--pool-multiple", type=int, default=4)
    m.add_argument("--turns", type=int, default=3)
    m.add_argument("--turn-len", type=int, default=48)
    m.add_argument("--output-len", type=int, default=16)
    m.add_argument("--max-num-seqs", type=int, default=2)
    m.add_argument("--offloading-gib", type=float, default=2.0)
    for q in (r, m):
        q.add_argument("--model", default="SmolLM2-135M-Instruct")
        q.add_argument("--threads", type=int, default=2)
        q.add_argument("--json-output", default=None)
    a = p.parse_args()
    info = _machine()
    res = restart_ttft(a) if a.cmd == "restart-ttft" else multiturn(a)
    res.update(info, loadavg_end=os.getloadavg(), benchmark=a.cmd)
    print(json.dumps(res, indent=1))
    if a.json_output:
        with open(a.json_output, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
