"""The OpenAI server on the real SmolLM2, started as a subprocess, driven by `openai` and httpx."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import httpx
import pytest
from server_helpers import serve

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    with serve([MODEL, "--dtype", "float32", "--api-key", API_KEY, "--max-model-len", "1024",
                "--kv-cache-memory", str(256 * 1024**2), "--max-num-batched-tokens", "256",
                "--disable-log-stats"], timeout=120) as (base, proc):
        yield base, proc


def _h():
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


PROMPTS = [f"Write a short sentence about the number {i}." for i in range(16)]


def _alone(client, prompt, max_tokens=24):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_models_health_version(server):
    base, _ = server
    r = httpx.get(base + "/v1/models", headers=_h())
    assert r.status_code == 200
    data = r.json()["data"]
    assert data[0]["id"] == MODEL and data[0]["max_model_len"] == 1024
    assert httpx.get(base + "/health").status_code == 200
    assert "version" in httpx.get(base + "/version").json()


def test_auth_required(server):
    base, _ = server
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401
    assert "error" in r.json()
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_chat_and_stream_equals_non_stream(client):
    # NOTE: the bare question's first answer token is a near tie for this model ("The" over "L" by
    # 0.03-0.27 nats, its side depending on dtype and on float vs int8 activations); asked to start
    # with "The capital", every token before "Paris" leads by >= 2 nats in each path
    msgs = [{"role": "user", "content": "What is the capital of France? Start your answer with 'The capital'."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert all(c.usage is None for c in chunks)


def test_include_usage_and_n(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3,
                                            temperature=1.0, seed=7, stream=True,
                                            stream_options={"include_usage": True}))
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 30
    finished = {}
    texts = {0: "", 1: "", 2: ""}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                assert ch.index not in finished
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) > 1


def test_utf8_stream_has_no_replacement_chars(client):
    r = client.completions.create(model=MODEL, prompt="Emoji party: 🎉🎉 🐍🚀 日本語のテキスト", max_tokens=24,
                                  temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in r if c.choices)
    assert "\ufffd" not in text
    assert text == _alone(client, "Emoji party: 🎉🎉 🐍🚀 日本語のテキスト")


def test_16_concurrent_streams_equal_alone(server, client):
    base, _ = server
    alone = [_alone(client, p) for p in PROMPTS]

    async def one(c: httpx.AsyncClient, p: str) -> str:
        text = ""
        async with c.stream("POST", base + "/v1/completions", headers=_h(),
                            json={"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0,
                                  "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    d = json.loads(line[6:])
                    text += "".join(ch["text"] for ch in d["choices"])
        return text

    async def run_all():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    streamed = asyncio.run(run_all())
    assert streamed == alone


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_disconnect_mid_stream_frees_request(server, client):
    base, _ = server

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", base + "/v1/completions", headers=_h(),
                                json={"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500,
                                      "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
                n = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                    if n >= 3:
                        break  # leave mid-stream

    asyncio.run(go())
    deadline = time.time() + 20
    while time.time() < deadline and _metric(base, "pagedllm:num_requests_running") != 0:
        time.sleep(0.2)
    assert _metric(base, "pagedllm:num_requests_running") == 0
    assert _metric(base, "pagedllm:kv_cache_usage_perc") == 0
    assert _alone(client, PROMPTS[0])


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi " * 1100}, None),
    ({"prompt": "hi", "max_tokens": 1024}, None),
    ({"prompt": [1, 2, 10**8]}, None),
    ({"prompt": "hi", "stream": True, "temperature": -1}, "temperature"),
])
def test_errors_then_next_request_succeeds(server, client, body, param):
    base, _ = server
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, **body}, headers=_h())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == 400
    if param:
        assert err["param"] == param or param in err["message"]
    if body.get("max_tokens") == 1024:
        assert "1024" in err["message"]
    assert _alone(client, "Hello", 4)


def test_other_errors(server):
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=_h())
    assert r.status_code == 400
    r = httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"}, headers=_h())
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={**_h(), "content-type": "application/json"})
    assert r.status_code in (400, 422) and "error" in r.json()


def test_more_bad_inputs_are_400(server):
    base, _ = server
    msgs = [{"role": "user", "content": "hi"}]
    # A lone surrogate is valid JSON but not encodable text.
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800 hi"}], "max_tokens": 3}' % MODEL.encode()
    r = httpx.post(base + "/v1/chat/completions", content=raw, headers={**_h(), "content-type": "application/json"})
    assert r.status_code == 400, r.text
    r = httpx.post(base + "/v1/chat/completions", headers=_h(), json={
        "model": MODEL, "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto"})
    assert r.status_code == 400 and "tool" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", headers=_h(), json={"model": MODEL, "prompt": "hi", "n": 129})
    assert r.status_code == 400
    r = httpx.post(base + "/v1/completions", headers=_h(), json={"model": MODEL, "prompt": "hi", "seed": 2**70})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    # A prompt that alone is too long is reported as such.
    r = httpx.post(base + "/v1/completions", headers=_h(), json={"model": MODEL, "prompt": "hello " * 1100,
                                                                 "max_tokens": 2})
    assert r.status_code == 400 and "input tokens" in r.json()["error"]["message"]


def test_chat_template_kwargs_override_and_cors(server):
    base, _ = server
    msgs = [{"role": "user", "content": "hi"}]
    a = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": msgs}).json()
    b = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": msgs,
                                             "chat_template_kwargs": {"add_generation_prompt": False}}).json()
    assert b["count"] < a["count"]
    r = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers.get("access-control-allow-origin") in ("*", "http://example.com")


def test_tokenize_detokenize_metrics(server):
    base, _ = server
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    d = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    text = httpx.get(base + "/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "num_preemptions_total",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "prefix_cache_queries_total", "prefix_cache_hits_total"]:
        assert f"pagedllm:{name}" in text, name
    assert _metric(base, "pagedllm:generation_tokens_total") > 0


def test_use_beam_search_ranked_choices(server):
    """vLLM's use_beam_search on the real model: n choices, distinct, ranked by cumulative logprob
    (ignore_eos and a fixed length: the length penalty cannot reorder them)."""
    body = {"model": MODEL, "prompt": "The capital of France is", "use_beam_search": True, "n": 3,
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = httpx.post(server[0] + "/v1/completions", json=body, headers=_h(), timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert len(ch) == 3 and len({c["text"] for c in ch}) == 3
    cums = [sum(c["logprobs"]["token_logprobs"]) for c in ch]
    assert all(len(c["logprobs"]["token_logprobs"]) == 6 for c in ch)
    assert cums == sorted(cums, reverse=True)


def test_sigterm_aborts_streams_and_exits_zero(server):
    base, proc = server
    finishes = []
    unstreamed = []

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            # a non-streamed request in flight at shutdown gets a 503 error, not a 200 without choices
            pending = asyncio.ensure_future(c.post(base + "/v1/chat/completions", headers=_h(), json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 800, "ignore_eos": True}))
            async with c.stream("POST", base + "/v1/completions", headers=_h(),
                                json={"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 800,
                                      "ignore_eos": True, "stream": True}) as resp:
                n = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        d = json.loads(line[6:])
                        finishes.extend(ch["finish_reason"] for ch in d["choices"] if ch["finish_reason"])
                        if n == 3:
                            proc.send_signal(signal.SIGTERM)
            unstreamed.append(await pending)

    asyncio.run(go())
    assert finishes == ["abort"]
    r = unstreamed[0]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "shutting down" in err["message"]
    assert proc.wait(timeout=30) == 0
