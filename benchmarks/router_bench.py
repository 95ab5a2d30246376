"""``pagedllm router`` benchmark: a multi-turn chat trace over 2 SmolLM2 replicas (one thread each),
``--policy prefix`` against ``--policy least-load``, and the router's added latency on loopback.

Trace: ``--conversations`` conversations sharing one system prompt, ``--turns`` user turns each
(the conversation's history grows by the assistant's reply every turn), ``--concurrency``
conversations running at once (each sends its next turn ``--think-time`` seconds, exponential, after the last reply is in). Every
request streams; TTFT is the time to the first content chunk. Each policy runs the same trace
on freshly reset prefix caches; the prefix cache hit rate is the replicas' own
(``pagedllm:prefix_cache_hits_total / queries_total`` over the run).

Overhead: ``--overhead-requests`` pairs of identical requests, one direct to a replica and one
through a prefix-policy router over that replica alone (so both reach the same engine),
interleaved; reported: the p50 of the per-pair differences for ``GET /v1/models`` (pure proxy) and
for a 1-token chat completion (proxy + render + tokenize + hash + route), and the router's own
``pagedllm_router_routing_seconds``.

Usage: ``python benchmarks/router_bench.py [--out FILE.json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_helpers import free_port, serve  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def replica(kv_port: int, kv_mem: str, max_model_len: int):
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_port}"})
    return serve([MODEL, "--max-model-len", str(max_model_len), "--kv-cache-memory", kv_mem, "--disable-log-stats",
                  "--disable-log-requests", "--kv-events-config", cfg, "--max-num-seqs", "16"], timeout=300)


class RouterProc:
    def __init__(self, args):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "router", *args, "--host",
                                      "127.0.0.1", "--port", str(self.port)], env=env)
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("router did not start")
            time.sleep(0.2)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def metric(base: str, name: str) -> float:
    return sum(float(x.rsplit(" ", 1)[1]) for x in httpx.get(base + "/metrics").text.splitlines()
               if x.startswith(name + "{") or x.startswith(name + " "))


WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact river music garden story window light").split()


def make_trace(n_conv: int, turns: int, seed: int = 0, system_words: int = 100, user_words: int = 40):
    rng = random.Random(seed)
    system = ("You are a helpful assistant for the Acme travel company. " + " ".join(
        rng.choice(WORDS) for _ in range(system_words)) + ". Answer briefly.")
    convs = []
    for c in range(n_conv):
        convs.append([f"Question {t + 1} of conversation {c}: tell me about the " + " ".join(
            rng.choice(WORDS) for _ in range(user_words)) for t in range(turns)])
    return system, convs


def run_trace(base: str, system: str, convs, concurrency: int, max_tokens: int, think: float,
              log: list | None = None):
    ttfts: list[float] = []
    lock = threading.Lock()
    start = time.perf_counter()
    todo = list(range(len(convs)))
    client = httpx.Client(timeout=600)

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop(0)
            msgs = [{"role": "system", "content": system}]
            rng = random.Random(c)
            for turn, user in enumerate(convs[c]):
                time.sleep(rng.expovariate(1.0 / think) if think > 0 else 0.0)
                msgs.append({"role": "user", "content": user})
                t0 = time.perf_counter()
                sent_messages = list(msgs)
                first = None
                text = []
                with client.stream("POST", base + "/v1/chat/completions", json={
                        "model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}) as r:
                    served_by = r.headers.get("x-pagedllm-replica")
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        d = json.loads(line[6:])
                        delta = d["choices"][0]["delta"].get("content") if d.get("choices") else None
                        if delta:
                            if first is None:
                                first = time.perf_counter() - t0
                            text.append(delta)
                with lock:
                    ttfts.append(first if first is not None else time.perf_counter() - t0)
                    if log is not None:
                        log.append({"conversation": c, "turn": turn, "arrival_s": t0 - start,
                                    "messages": sent_messages, "reply": "".join(text), "ttft_s": ttfts[-1],
                                    "replica": served_by})
                msgs.append({"role": "assistant", "content": "".join(text)})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, time.perf_counter() - t0


def measure_overhead(ra: str, kv_port: int, system: str, a, res: dict) -> None:
    """Router overhead: direct to replica ``ra`` vs a prefix-policy router over it alone, interleaved pairs."""
    if a.overhead_requests <= 0:
        router = None
    else:
        router = RouterProc(["--replica", ra, "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}", "--policy",
                         "prefix"])
    if router is not None:
        try:
            c = httpx.Client(timeout=60)
            body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": "Say hi."}],
                    "max_tokens": 1, "temperature": 0}
            for _ in range(5):  # warm both paths (connections, the prefix cache)
                c.get(ra + "/v1/models"), c.get(router.base + "/v1/models")
                c.post(ra + "/v1/chat/completions", json=body), c.post(router.base + "/v1/chat/completions", json=body)
            for name, call in (("models", lambda b: c.get(b + "/v1/models")),
                               ("chat_1_token", lambda b: c.post(b + "/v1/chat/completions", json=body))):
                diffs, direct, via = [], [], []
                for i in range(a.overhead_requests):
                    order = (ra, router.base) if i % 2 == 0 else (router.base, ra)
                    t = {}
                    for b in order:
                        t0 = time.perf_counter()
                        assert call(b).status_code == 200
                        t[b] = time.perf_counter() - t0
                    direct.append(t[ra])
                    via.append(t[router.base])
                    diffs.append(t[router.base] - t[ra])
                res[f"overhead_{name}"] = {"p50_added_ms": 1e3 * statistics.median(diffs),
                                           "p50_direct_ms": 1e3 * statistics.median(direct),
                                           "p50_via_router_ms": 1e3 * statistics.median(via)}
                print(name, json.dumps(res[f"overhead_{name}"]), flush=True)
            n = metric(router.base, "pagedllm_router_routing_seconds_count")
            s = metric(router.base, "pagedllm_router_routing_seconds_sum")
            res["routing_seconds_mean_ms"] = 1e3 * s / max(n, 1)
        finally:
            router.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--think-time", type=float, default=1.0,
                    help="mean seconds (exponential) a user waits before each turn")
    ap.add_argument("--system-words", type=int, default=45, help="words of the shared system prompt")
    ap.add_argument("--user-words", type=int, default=40, help="words of a user turn")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="88MiB")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--policies", default="least-load,prefix")
    ap.add_argument("--overhead-requests", type=int, default=100)
    ap.add_argument("--save-trace", default=None,
                    help="write the least-load run's requests as a `pagedllm simulate` trace (JSONL)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    system, convs = make_trace(a.conversations, a.turns, system_words=a.system_words, user_words=a.user_words)
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    res: dict = {"trace": vars(a), "cpu": cpu, "loadavg_before": os.getloadavg()}
    kv = [free_port(), free_port()]
    logs: dict[str, list] = {}
    with replica(kv[0], a.kv_cache_memory, a.max_model_len) as (ra, _), \
            replica(kv[1], a.kv_cache_memory, a.max_model_len) as (rb, _):
        reps = [ra, rb]
        # First (on fresh replicas), so that a run cut short by its time limit still has it.
        measure_overhead(ra, kv[0], system, a, res)
        for policy in a.policies.split(","):
            for r in reps:
                httpx.post(r + "/reset_prefix_cache")
            time.sleep(0.5)
            router = RouterProc(["--replica", ra, "--replica", rb, "--kv-events-endpoint", f"tcp://127.0.0.1:{kv[0]}",
                                 "--kv-events-endpoint", f"tcp://127.0.0.1:{kv[1]}", "--policy", policy])
            try:
                q0 = sum(metric(r, "pagedllm:prefix_cache_queries_total") for r in reps)
                h0 = sum(metric(r, "pagedllm:prefix_cache_hits_total") for r in reps)
                logs[policy] = []
                ttfts, wall = run_trace(router.base, system, convs, a.concurrency, a.max_tokens, a.think_time,
                                        logs[policy])
                q1 = sum(metric(r, "pagedllm:prefix_cache_queries_total") for r in reps)
                h1 = sum(metric(r, "pagedllm:prefix_cache_hits_total") for r in reps)
                dec = httpx.get(router.base + "/metrics").text
                late = [x["ttft_s"] for x in logs[policy] if x["turn"] > 0]
                where = {(x["conversation"], x["turn"]): x["replica"] for x in logs[policy]}
                same = [where[(c, t)] == where.get((c, t - 1)) for c, t in where if t > 0]
                res[policy] = {"requests": len(ttfts), "hit_rate": (h1 - h0) / max(q1 - q0, 1),
                               "prompt_tokens": q1 - q0, "hit_tokens": h1 - h0,
                               "preemptions": sum(metric(r, "pagedllm:num_preemptions_total") for r in reps),
                               "mean_ttft_s": statistics.mean(ttfts), "p50_ttft_s": statistics.median(ttfts),
                               "mean_ttft_turns_2_8_s": statistics.mean(late) if late else None,
                               "wall_s": wall,
                               # (a turn sent to the replica of the conversation's previous turn)
                               "same_replica_as_previous_turn": sum(same) / max(len(same), 1),
                               "decisions": [x for x in dec.splitlines()
                                                             if x.startswith("pagedllm_router_routing_decisions_total")]}
                print(policy, json.dumps({k: v for k, v in res[policy].items() if k != "decisions"}), flush=True)
                print(json.dumps([x for x in res[policy]["decisions"]]), flush=True)
                if a.out:  # (after each policy: a run cut short keeps what it measured)
                    with open(a.out, "w") as f:
                        json.dump(res, f, indent=1)
            finally:
                router.close()
        if "prefix" in res and "least-load" in res:
            res["hit_rate_ratio"] = res["prefix"]["hit_rate"] / max(res["least-load"]["hit_rate"], 1e-9)
            res["mean_ttft_ratio"] = res["prefix"]["mean_ttft_s"] / res["least-load"]["mean_ttft_s"]
        if a.save_trace and logs:
            # The first policy's requests at their send times, tokenized as the replica does it
            # (its /tokenize); the replies re-tokenized (the simulator emits them, so that the
            # next turn's prompt, which holds the reply, can hit its blocks).
            tc = httpx.Client(timeout=60)
            with open(a.save_trace, "w") as f:
                for x in sorted(logs[a.policies.split(",")[0]], key=lambda x: x["arrival_s"]):
                    p = tc.post(ra + "/tokenize", json={"model": MODEL, "messages": x["messages"]}).json()["tokens"]
                    o = tc.post(ra + "/tokenize", json={"model": MODEL, "prompt": x["reply"],
                                                        "add_special_tokens": False}).json()["tokens"]
                    f.write(json.dumps({"request_id": f"conv-{x['conversation']}-turn-{x['turn']}",
                                        "arrival_s": round(x["arrival_s"], 6), "prompt_token_ids": p,
                                        "max_tokens": a.max_tokens, "output_token_ids": o[:a.max_tokens],
                                        "conversation_id": f"conv-{x['conversation']}"}) + "\n")
    res["loadavg_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in res.items() if k not in ("prefix", "least-load")}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
