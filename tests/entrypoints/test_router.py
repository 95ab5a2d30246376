"""``pagedllm router`` over real ``pagedllm serve`` replicas (subprocesses) of a tiny random Llama:
responses and streams through the router equal direct calls; prefix routing sends a conversation
to the replica whose KV events say it holds the prefix, else by load; drain; a replica killed
mid-stream gives the client an error event and later requests avoid it; bad flags and URLs are
one-line start-up errors (exit 2)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import free_port, serve

TEMPLATE = ("{% for m in messages %}w5 {{ m['role'] }} {{ m['content'] }} w6 {% endfor %}"
            "{% if add_generation_prompt %}w7 assistant{% endif %}")
MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny random Llama of tests/arch_cases.py with 1024 positions and a chat template."""
    from arch_cases import CASES, build_hf, tiny_tokenizer

    path = str(tmp_path_factory.mktemp("router_tiny"))
    class_name, factory = CASES["llama"]
    cfg = factory()
    cfg.max_position_embeddings = 1024
    build_hf(cfg, class_name).save_pretrained(path)
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def _replica(ckpt):
    kv = free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv}"})
    return serve([ckpt, "--served-model-name", MODEL, "--dtype", "float32", "--block-size", "4",
                  "--max-model-len", "1024", "--kv-cache-memory", "16MiB", "--disable-log-stats",
                  "--disable-log-requests", "--kv-events-config", cfg], stop_timeout=10), f"tcp://127.0.0.1:{kv}"


class _Router:
    def __init__(self, args: list[str]):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "router", *args,
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("router exited:\n" + self.proc.stdout.read())
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "router did not start"
            time.sleep(0.2)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def state(self) -> dict:
        return httpx.get(self.base + "/router/replicas").json()

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.base + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def fleet(ckpt):
    """Two replicas and a prefix-policy router over them: (router, [replica URLs])."""
    (cm_a, kv_a), (cm_b, kv_b) = _replica(ckpt), _replica(ckpt)
    with cm_a as (a, _), cm_b as (b, _):
        r = _Router(["--replica", a, "--replica", b, "--kv-events-endpoint", kv_a, "--kv-events-endpoint", kv_b,
                     "--policy", "prefix", "--health-check-interval", "0.5"])
        try:
            yield r, [a, b]
        finally:
            r.close()


def _norm(raw: bytes) -> bytes:
    """A response with its per-request ids, timestamps and cached-token counts (the second call
    hits the prefix cache; Anthropic's input_tokens are the uncached part) blanked."""
    raw = re.sub(rb'"(id|request_id)":"[^"]*"', rb'"\1":"X"', raw)
    return re.sub(rb'"(created|created_at|cached_tokens|cache_read_input_tokens|input_tokens)":[0-9.]+', rb'"\1":0',
                  raw)


def _words(n: int, start: int) -> str:
    return " ".join(f"w{start + (i * 7) % 200}" for i in range(n))


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": _words(9, 10), "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _words(6, 20)}], "max_tokens": 8,
                              "temperature": 0, "ignore_eos": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": _words(6, 30)}], "max_tokens": 8,
                      "temperature": 0}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_and_streams_equal_direct(fleet, path, body, stream):
    router, _ = fleet
    body = dict(body, model=MODEL, stream=stream)
    via = httpx.post(router.base + path, json=body, timeout=60)
    assert via.status_code == 200, via.text
    rep = via.headers["x-pagedllm-replica"]
    direct = httpx.post(rep + path, json=body, timeout=60)
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert _norm(via.content) == _norm(direct.content)
    if stream:
        assert via.content.count(b"data: ") >= 8


def test_models_ollama_and_errors_pass_through(fleet):
    router, urls = fleet
    m = httpx.get(router.base + "/v1/models").json()
    assert m["data"][0]["id"] == MODEL
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w3 w4"}], "stream": True,
            "options": {"temperature": 0, "num_predict": 5}}
    via = httpx.post(router.base + "/api/chat", json=body, timeout=60)
    direct = httpx.post(via.headers["x-pagedllm-replica"] + "/api/chat", json=body, timeout=60)
    lines = [json.loads(x) for x in via.text.splitlines()]
    assert [x["message"]["content"] for x in lines] == [json.loads(x)["message"]["content"]
                                                          for x in direct.text.splitlines()]
    assert lines[-1]["done"] is True
    # The replica's own 400 comes back unchanged.
    bad = httpx.post(router.base + "/v1/completions", json={"model": MODEL, "prompt": "w3", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def _chat(router, messages, **kw):
    r = httpx.post(router.base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.headers["x-pagedllm-replica"], r.json()["choices"][0]["message"]["content"]


def _wait_blocks(router, url, at_least):
    deadline = time.time() + 20
    while True:
        st = {r["url"]: r for r in router.state()["replicas"]}[url]
        if st["index_blocks"] >= at_least:
            return st
        assert time.time() < deadline, st
        time.sleep(0.1)


def test_prefix_routing_follows_the_replicas_kv_events(fleet):
    router, (a, b) = fleet
    httpx.post(a + "/reset_prefix_cache")
    httpx.post(b + "/reset_prefix_cache")
    # Two conversations, each started on a chosen replica (the other one draining).
    convs = {}
    for name, home, other, start in (("x", a, b, 40), ("y", b, a, 90)):
        assert httpx.post(router.base + "/router/drain", json={"replica": other}).json()["draining"]
        msgs = [{"role": "system", "content": _words(24, start)}, {"role": "user", "content": _words(4, start + 1)}]
        got, reply = _chat(router, msgs)
        assert got == home
        assert httpx.post(router.base + "/router/undrain", json={"replica": other}).json()["draining"] is False
        # The router learnt the blocks from the replica's own BlockStored events.
        st = _wait_blocks(router, home, 8)
        assert st["block_size"] == 4
        convs[name] = (home, msgs + [{"role": "assistant", "content": reply}])
    before = router.metric("pagedllm_router_routing_decisions_total", reason="prefix")
    for turn in range(3):
        for name, (home, msgs) in convs.items():
            msgs = msgs + [{"role": "user", "content": _words(3, 150 + turn)}]
            got, reply = _chat(router, msgs)
            assert got == home, (name, turn)
            convs[name] = (home, msgs + [{"role": "assistant", "content": reply}])
    assert router.metric("pagedllm_router_routing_decisions_total", reason="prefix") == before + 6
    assert router.metric("pagedllm_router_matched_blocks_total") > 0
    assert router.metric("pagedllm_router_prefix_index_capacity_blocks") == 1_000_000
    assert router.metric("pagedllm_router_prefix_index_blocks") >= 16
    # The earlier turns' text pieces came from the router's token cache.
    assert router.metric("pagedllm_router_token_cache_hits_total") > 0
    assert 0 < router.metric("pagedllm_router_token_cache_entries") <= \
        router.metric("pagedllm_router_token_cache_capacity_entries")
    # The replica's own prefix cache agrees: the follow-ups hit it.
    m = httpx.get(a + "/metrics").text
    hits = sum(float(x.rsplit(" ", 1)[1]) for x in m.splitlines() if x.startswith("pagedllm:prefix_cache_hits"))
    assert hits > 0
    # A prompt no replica holds goes by load (reason "load").
    before = router.metric("pagedllm_router_routing_decisions_total", reason="load")
    _chat(router, [{"role": "user", "content": _words(10, 7)}])
    assert router.metric("pagedllm_router_routing_decisions_total", reason="load") == before + 1
    # /reset_prefix_cache on a replica: AllBlocksCleared empties its part of the index.
    httpx.post(a + "/reset_prefix_cache")
    deadline = time.time() + 20
    while {r["url"]: r for r in router.state()["replicas"]}[a]["index_blocks"]:
        assert time.time() < deadline
        time.sleep(0.1)


def test_replica_killed_mid_stream(ckpt, fleet):
    """A third replica dies mid-stream: the client gets an error event; later requests go to
    the live one; the retry of a refused connection is counted."""
    _, (a, _) = fleet
    cm, _ = _replica(ckpt)
    with cm as (c, proc):
        router = _Router(["--replica", c, "--replica", a, "--policy", "round-robin",
                          "--health-check-interval", "60"])
        try:
            body = {"model": MODEL, "prompt": _words(5, 3), "max_tokens": 900, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            served = None
            while served != c:  # round-robin: at most two tries to land on c
                with httpx.stream("POST", router.base + "/v1/completions", json=body, timeout=60) as r:
                    served = r.headers["x-pagedllm-replica"]
                    if served != c:
                        r.read()
                        continue
                    chunks = r.iter_bytes()
                    first = next(chunks)
                    assert first.startswith(b"data: ")
                    os.kill(proc.pid, signal.SIGSTOP)
                    os.kill(proc.pid, signal.SIGKILL)
                    rest = b"".join(chunks)
            events = [e for e in (first + rest).decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2].removeprefix("data: "))["error"]
            assert err["code"] == 502 and c in err["message"]
            assert router.metric("pagedllm_router_stream_errors_total", replica=c) == 1
            st = {x["url"]: x for x in router.state()["replicas"]}
            assert st[c]["healthy"] is False and st[a]["healthy"] is True
            for _ in range(3):
                r = httpx.post(router.base + "/v1/completions", json=dict(body, stream=False, max_tokens=2))
                assert r.status_code == 200 and r.headers["x-pagedllm-replica"] == a
            assert router.metric("pagedllm_router_requests_total", replica=c, code="error") == 1
        finally:
            router.close()


def test_connection_refused_is_retried_elsewhere(fleet):
    """A replica that refuses connections (it never started the request): the request is retried
    on the other one and the client sees no error."""
    _, (a, _) = fleet
    dead = f"http://127.0.0.1:{free_port()}"
    from pagedllm.router.server import RouterApp

    ra = RouterApp([dead, a], "round-robin", health_check_interval=60)
    from fastapi.testclient import TestClient

    with TestClient(ra.app) as client:
        for _ in range(2):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "w3 w4", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-pagedllm-replica"] == a
        text = client.get("/metrics").text
        assert f'pagedllm_router_retries_total{{replica="{dead}"}} 1.0' in text
        assert f'pagedllm_router_replica_healthy{{replica="{dead}"}} 0.0' in text
        ra.replicas[1].healthy = False
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "w3", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize("args,msg", [
    (["--replica", "localhost:8000"], "--replica: 'localhost:8000' is not an http(s)://HOST:PORT URL"),
    (["--replica", "http://127.0.0.1:1"], "--replica: cannot reach http://127.0.0.1:1"),
    (["--replica", "http://h:1", "--replica", "http://h:1/"], "--replica: http://h:1 is given twice"),
    (["--replica", "http://h:1", "--policy", "prefix"], "--policy prefix: needs --kv-events-endpoint"),
    (["--replica", "http://h:1", "--kv-events-endpoint", "tcp://h:1", "--kv-events-endpoint", "tcp://h:2"],
     "--kv-events-endpoint: give one per --replica (1), got 2"),
    (["--replica", "http://h:1", "--policy", "nope"], "invalid choice: 'nope'"),
])
def test_bad_flags_are_one_line_exit_2(args, msg):
    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "router", *args], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert msg in lines[-1] and lines[-1].startswith("pagedllm router: error:"), p.stderr
    if "invalid choice" not in msg:
        assert len(lines) == 1


def test_index_bound_evicts_and_counts():
    """The prefix index holds at most max_blocks blocks; the oldest go first and are counted."""
    from pagedllm.router.index import PrefixIndex, chain_hashes

    idx = PrefixIndex(max_blocks=6)
    toks = list(range(40))
    idx.block_stored(0, [f"h{i}" for i in range(10)], None, toks, 4)
    st = idx.stats()
    assert len(idx) == 6 and st["capacity"] == 6 and st["evicted"] + st["ext_evicted"] == 4
    # The first blocks went: the prompt's chain no longer matches from its start.
    assert idx.match(chain_hashes(toks, 4)) == {}
    idx2 = PrefixIndex(max_blocks=100)
    idx2.block_stored(0, ["a", "b"], None, toks[:8], 4)
    idx2.block_stored(1, ["p"], None, toks[:4], 4)
    idx2.block_stored(0, ["c"], "b", toks[8:12], 4)  # chained on the replica's own parent hash
    assert idx2.match(chain_hashes(toks[:14], 4)) == {0: 3, 1: 1}
    idx2.block_removed(0, ["a"])
    assert idx2.match(chain_hashes(toks[:14], 4)) == {1: 1}
    idx2.block_stored(1, ["q"], "unknown-parent", toks[4:8], 4)
    assert idx2.stats()["unchained"] == 1


def test_policies_choose_as_documented():
    from pagedllm.router.policy import PolicyConfig, Router

    rr = Router("round-robin")
    assert [rr.choose([0, 1, 2], [5, 0, 0]).replica for _ in range(4)] == [0, 1, 2, 0]
    ll = Router("least-load")
    assert ll.choose([0, 1, 2], [3, 1, 2]).replica == 1
    assert ll.choose([0, 2], [3, 1, 2]).replica == 2  # only eligible ones
    st = Router("sticky")
    picks = {st.choose([0, 1, 2], [0, 0, 0], session=f"s{i}").replica for i in range(30)}
    assert len(picks) > 1
    assert all(st.choose([0, 1, 2], [i, 0, 9], session="abc").replica == st.choose([0, 1, 2], [0, 0, 0],
                                                                                   session="abc").replica
               for i in range(3))
    px = Router("prefix", PolicyConfig(cache_threshold=0.5, balance_abs_threshold=2, balance_rel_threshold=1.5))
    d = px.choose([0, 1], [1, 0], matches={0: 6}, prompt_blocks=8)
    assert (d.replica, d.reason, d.matched_blocks) == (0, "prefix", 6)
    d = px.choose([0, 1], [1, 0], matches={0: 3}, prompt_blocks=8)  # 3/8 <= threshold: by load
    assert (d.replica, d.reason) == (1, "load")
    d = px.choose([0, 1], [4, 0], matches={0: 8}, prompt_blocks=8)  # imbalanced: by load
    assert (d.replica, d.reason) == (1, "load")
    d = px.choose([1], [0, 0], matches={0: 8}, prompt_blocks=8)  # the holder is not eligible
    assert (d.replica, d.reason) == (1, "load")
    # Cost = share of the prompt to compute + 0.1 x in flight: a shared prefix (half the prompt)
    # held by replica 0 alone draws requests there until it has 5 more in flight, then they spread.
    soft = Router("prefix", PolicyConfig(cache_threshold=0.3))
    d = soft.choose([0, 1], [4, 0], matches={0: 4}, prompt_blocks=8)
    assert (d.replica, d.reason, d.matched_blocks) == (0, "prefix", 4)
    d = soft.choose([0, 1], [6, 0], matches={0: 4}, prompt_blocks=8)
    assert (d.replica, d.reason, d.matched_blocks) == (1, "load", 0)
    d = soft.choose([0, 1], [6, 0], matches={0: 7, 1: 1}, prompt_blocks=8)  # a conversation's history
    assert (d.replica, d.reason) == (0, "prefix")
    with pytest.raises(ValueError, match="policy"):
        Router("fastest")


def test_token_cache_equals_full_encode_and_keeps_its_bound():
    from arch_cases import tiny_tokenizer

    from pagedllm.router.tokens import SegmentTokenizer

    tok = tiny_tokenizer()
    st = SegmentTokenizer(tok, max_entries=3, verify=1000)
    texts = ["<s> w5 w6 </s> w7", "<s> w5 w6 </s> w8 w9", "w3</s><s>w4 w4", ""] + \
        [f"<s> w{10 + i} </s> w{40 + i} w3" for i in range(6)]
    for text in texts + texts:
        assert st.encode(text) == tok.encode(text, add_special_tokens=False), text
        assert st.stats()["entries"] <= 3
    assert st.enabled, st.disabled_reason
    s = st.stats()
    assert s["hits"] > 0 and s["misses"] > 0 and s["evicted"] > 0 and s["capacity"] == 3
    # add_special_tokens=True is the tokenizer's post-processor's business: a full encode.
    assert st.encode("w5 w6", True) == tok.encode("w5 w6", add_special_tokens=True)
    with pytest.raises(ValueError, match="bounds"):
        SegmentTokenizer(tok, max_entries=0)
