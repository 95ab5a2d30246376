"""``pagedllm serve MODEL --data-parallel-size 2``: two replica processes behind the router on one
port (``pagedllm.router.dp_serve``), with a tiny random Llama: both replicas serve; greedy
completions, chats and streams through the front equal one replica's own answers; ``/metrics``
has both replicas' series (``engine="0"``, ``engine="1"``) beside the router's; a replica that
crashes turns ``/health`` 503 naming it while the other keeps serving; SIGTERM stops every child."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import psutil
import pytest
from server_helpers import serve, wait_for_status

TEMPLATE = ("{% for m in messages %}w5 {{ m['role'] }} {{ m['content'] }} w6 {% endfor %}"
            "{% if add_generation_prompt %}w7 assistant{% endif %}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from arch_cases import CASES, build_hf, tiny_tokenizer

    path = str(tmp_path_factory.mktemp("dp_tiny"))
    class_name, factory = CASES["llama"]
    cfg = factory()
    cfg.max_position_embeddings = 1024
    build_hf(cfg, class_name).save_pretrained(path)
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def front(ckpt):
    with serve([ckpt, "--served-model-name", "m", "--dtype", "float32", "--block-size", "4",
                "--max-model-len", "1024", "--kv-cache-memory", "16MiB", "--disable-log-stats",
                "--disable-log-requests", "--uvicorn-log-level", "warning", "--data-parallel-size", "2"],
               stop_timeout=40) as (base, proc):
        reps = [r["url"] for r in httpx.get(base + "/router/replicas").json()["replicas"]]
        yield base, proc, reps


def _norm(raw: bytes) -> bytes:
    raw = re.sub(rb'"(id|request_id)":"[^"]*"', rb'"\1":"X"', raw)
    return re.sub(rb'"(created|cached_tokens)":[0-9.]+', rb'"\1":0', raw)


def _words(n: int, start: int) -> str:
    return " ".join(f"w{start + (i * 7) % 200}" for i in range(n))


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(*(c.post(url, json=b) for b in bodies))


def test_both_replicas_serve_and_equal_one_replica(front):
    base, _, reps = front
    assert len(reps) == 2 and base not in reps
    bodies = [{"model": "m", "prompt": _words(6 + i, 3 + 11 * i), "max_tokens": 8, "temperature": 0,
               "ignore_eos": True} for i in range(8)]
    via = asyncio.run(_post_all(base + "/v1/completions", bodies))
    assert all(r.status_code == 200 for r in via), [r.text for r in via]
    served = {r.headers["x-pagedllm-replica"] for r in via}
    assert served == set(reps)  # 8 requests at once: the load fallback spreads them
    direct = asyncio.run(_post_all(reps[0] + "/v1/completions", bodies))
    assert [r.json()["choices"][0]["text"] for r in via] == [r.json()["choices"][0]["text"] for r in direct]
    metrics = httpx.get(base + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    done: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics):
        for smp in fam.samples:
            if smp.name == "pagedllm:request_success_total" and smp.value:
                done[smp.labels["engine"]] = done.get(smp.labels["engine"], 0.0) + smp.value
    assert set(done) == {"0", "1"} and sum(done.values()) >= 8, done
    assert metrics.count("# TYPE pagedllm:request_success_total counter") == 1
    assert "pagedllm_router_requests_total" in metrics


def test_chat_and_stream_equal_direct(front):
    base, _, reps = front
    msgs = [{"role": "system", "content": _words(30, 1)}, {"role": "user", "content": _words(12, 40)}]
    body = {"model": "m", "messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    d = httpx.post(r.headers["x-pagedllm-replica"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["message"] == d.json()["choices"][0]["message"]
    sbody = {"model": "m", "prompt": _words(9, 5), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
             "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=sbody, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        via = s.read()
        rep = s.headers["x-pagedllm-replica"]
    direct = httpx.post(rep + "/v1/completions", json=sbody, timeout=60).content
    assert _norm(via) == _norm(direct) and via.endswith(b"data: [DONE]\n\n")
    # The conversation's next turn goes where its prefix is (the replicas' KV events).
    follow = dict(body, messages=msgs + [{"role": "assistant", "content": "w9"},
                                         {"role": "user", "content": _words(5, 90)}])
    deadline = time.time() + 10
    while True:
        r2 = httpx.post(base + "/v1/chat/completions", json=follow, timeout=60)
        if r2.headers["x-pagedllm-replica"] == r.headers["x-pagedllm-replica"] or time.time() > deadline:
            break
        time.sleep(0.2)  # the events may not have arrived yet
    assert r2.headers["x-pagedllm-replica"] == r.headers["x-pagedllm-replica"]


def test_bad_flag_is_one_line_exit_2(ckpt):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", ckpt, "--data-parallel-size",
                        "2", "--data-parallel-router", "nope"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--data-parallel-router" in p.stderr


def test_replica_crash_is_reported_and_shutdown_stops_children(front):
    """Last in this module: kills a replica."""
    base, proc, reps = front
    kids = [k for k in psutil.Process(proc.pid).children() if k.is_running()]
    port_of = {k.pid: {c.laddr.port for c in k.net_connections(kind="tcp") if c.status == "LISTEN"}
               for k in kids}
    victim = next(k for k in kids if int(reps[1].rsplit(":", 1)[1]) in port_of[k.pid])
    victim.kill()
    # (no wait: the front reaps it when it next looks, i.e. at /health)
    h = wait_for_status(base + "/health", 503, timeout=15)
    assert h.status_code == 503
    assert "data-parallel replica 1" in h.json()["error"]["message"] and reps[1] in h.json()["error"]["message"]
    for i in range(4):  # the front does not hang: the live replica answers, the dead one is avoided
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": _words(5, i), "max_tokens": 2,
                                                        "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.headers["x-pagedllm-replica"] == reps[0], r.text
    st = {x["url"]: x for x in httpx.get(base + "/router/replicas").json()["replicas"]}
    assert st[reps[1]]["healthy"] is False and json.dumps(st[reps[0]]["healthy"]) == "true"
    survivors = [k for k in kids if k.pid != victim.pid]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(40) == 0
    gone, alive = psutil.wait_procs(survivors, timeout=20)
    assert not alive
