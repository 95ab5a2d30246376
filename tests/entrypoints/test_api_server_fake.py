"""HTTP-layer tests of the OpenAI-compatible server against the fake engine."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import make_arg_parser, parse_bytes

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from api_helpers import MODEL, assert_error, make_args, sse_events  # noqa: E402,F401  (tests use them)
from fake_engine import FakeAsyncLLM  # noqa: E402




# ---------------------------------------------------------------------------------------
# completions
# ---------------------------------------------------------------------------------------


def test_completion_shape(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["id"].startswith("cmpl-") and b["object"] == "text_completion"
    assert isinstance(b["created"], int) and b["model"] == MODEL
    (c,) = b["choices"]
    assert c["index"] == 0 and c["finish_reason"] == "length" and c["logprobs"] is None
    assert "stop_reason" in c and c["text"] == " The quick brown fox jumps"
    u = b["usage"]
    assert u["completion_tokens"] == 5 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + 5
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_default_max_tokens_16_and_prompt_forms(client, engine):
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = client.post("/v1/completions", json={"prompt": ["a", "b c"], "max_tokens": 2, "n": 2})
    b = r.json()
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    assert b["choices"][0]["text"] != b["choices"][1]["text"]  # samples differ
    assert b["usage"]["completion_tokens"] == 8
    r = client.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 1})
    assert len(r.json()["choices"]) == 2


def test_completion_stop_string(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "stop": [" fox"]})
    c = r.json()["choices"][0]
    assert c["text"] == " The quick brown" and c["finish_reason"] == "stop"
    assert c["stop_reason"] == " fox"


def test_completion_logprobs_and_echo(client, engine):
    r = client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert lp["tokens"] == [" The", " quick", " brown"]
    assert lp["text_offset"] == [0, 4, 10]
    assert lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    # -inf is reported as -9999.0 (strict JSON)
    assert -9999.0 in lp["top_logprobs"][0].values()
    assert "Infinity" not in r.text and "NaN" not in r.text

    r = client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2, "echo": True,
                                             "logprobs": 1})
    c = r.json()["choices"][0]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert c["text"] == "Hi there The quick"
    assert c["logprobs"]["token_logprobs"][0] is None
    assert c["logprobs"]["top_logprobs"][0] is None
    assert len(c["logprobs"]["tokens"]) == n_prompt + 2
    assert "".join(c["logprobs"]["tokens"]) == c["text"]

    r = client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hi there"


def test_completion_stream_framing(client):
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = sse_events(text)
    assert all("usage" not in e for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == " The quick brown fox"
    assert all(e["object"] == "text_completion" and e["id"].startswith("cmpl-") for e in events)
    assert len({e["id"] for e in events}) == 1
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_completion_stream_include_usage_n2(client):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True,
                                             "n": 2, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    usage_chunks = [e for e in events if e.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-1]
    assert events[-1]["choices"] == []
    u = events[-1]["usage"]
    assert u["completion_tokens"] == 6 and u["total_tokens"] == u["prompt_tokens"] + 6
    texts = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        finishes[c["index"]] += c["finish_reason"] is not None
    assert texts[0] == " The quick brown" and texts[1] == " quick brown fox"
    assert finishes == {0: 1, 1: 1}


def test_completion_stream_echo_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True,
                                             "echo": True, "logprobs": 0})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["text"].startswith("Hello")
    offs = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offs == sorted(offs) and offs[0] == 0


# ---------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]


def test_chat_shape_and_template(client, engine):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS,
                                                  "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion"
    (c,) = b["choices"]
    assert c["message"]["role"] == "assistant" and c["message"]["content"] == " The quick brown"
    assert c["finish_reason"] == "length" and c["logprobs"] is None
    prompt = engine.received[-1][0]
    assert prompt["prompt"].endswith("<|im_start|>assistant\n")
    assert "Hi\nthere" in prompt["prompt"]
    assert b["usage"]["prompt_tokens"] == len(prompt["prompt_token_ids"])


def test_chat_default_max_tokens_fills_context(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == engine.max_model_len


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2,
                                                  "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in content] == [" The", " quick"]
    first = content[0]
    assert first["logprob"] == -0.5 and first["bytes"] == list(b" The")
    assert len(first["top_logprobs"]) == 2
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_chat_stream_n2(client):
    r = client.post("/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 3, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[1]["choices"][0]["delta"]["role"] == "assistant"
    assert {events[0]["choices"][0]["index"], events[1]["choices"][0]["index"]} == {0, 1}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    content = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for e in events[2:-1]:
        (c,) = e["choices"]
        content[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finishes[c["index"]].append(c["finish_reason"])
    assert content[0] == " The quick brown" and content[1] == " quick brown fox"
    assert finishes == {0: ["length"], 1: ["length"]}


def test_openai_client(engine):
    openai = pytest.importorskip("openai")
    app = build_app(engine, make_args())
    with TestClient(app) as tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=tc)
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert comp.choices[0].text == " The quick brown"
        chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        assert chat.choices[0].message.content == " The quick"
        stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2,
                                                stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " The quick"
        assert chunks[-1].usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", temperature=-1)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1.0}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None),
    ("/v1/chat/completions", {"messages": []}, None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 100_000},
     "max_completion_tokens"),
])
def test_bad_requests_400_then_ok(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param)
    r = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
    assert r.status_code == 200


def test_bad_request_streaming_gets_status_first(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000, "stream": True})
    err = assert_error(r, 400)
    assert "maximum context length" in err["message"] and "256" in err["message"]
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "temperature": -2,
                                                  "stream": True})
    assert_error(r, 400, "temperature")


def test_malformed_json(client):
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert_error(r, 400)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": "lots"})
    assert_error(r, 400, "max_tokens")
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_unknown_model_404(client):
    err = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert "gpt-9" in err["message"] and err["type"] == "NotFoundError"
    assert_error(client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSGS}), 404)


def test_auth(engine):
    app = build_app(engine, make_args(api_key="sekret", served_model_name=["a", "b"]))
    with TestClient(app) as c:
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        r = c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        data = r.json()
        assert data["object"] == "list"
        assert [m["id"] for m in data["data"]] == ["a", "b"]
        m = data["data"][0]
        assert m["object"] == "model" and m["owned_by"] == "pagedllm"
        assert m["max_model_len"] == engine.max_model_len
        # OpenAI's "retrieve model" (client.models.retrieve): one card, 404 for a name not served
        assert_error(c.get("/v1/models/b"), 401)
        one = c.get("/v1/models/b", headers={"Authorization": "Bearer sekret"})
        assert one.status_code == 200 and one.json()["id"] == "b" and one.json()["object"] == "model"
        assert one.json()["max_model_len"] == engine.max_model_len
        assert "does not exist" in assert_error(c.get("/v1/models/org/nope", headers={
            "Authorization": "Bearer sekret"}), 404, "model")["message"]
        # non-/v1 routes are open
        assert c.get("/health").status_code == 200
        assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        r = c.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1},
                   headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["model"] == "b"


# ---------------------------------------------------------------------------------------
# misc endpoints
# ---------------------------------------------------------------------------------------


def test_misc_endpoints(client, engine):
    assert client.get("/health").status_code == 200
    assert "version" in client.get("/version").json()
    assert client.post("/reset_prefix_cache").status_code == 200
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    b = r.json()
    assert b["count"] == len(b["tokens"]) and b["max_model_len"] == 256
    assert len(b["token_strs"]) == b["count"]
    d = client.post("/detokenize", json={"tokens": b["tokens"]}).json()
    assert d == {"prompt": "Hello world"}
    r = client.post("/tokenize", json={"messages": MSGS})
    toks = r.json()["tokens"]
    assert engine.tokenizer.decode(toks).endswith("<|im_start|>assistant\n")
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")


def test_metrics_after_requests(client):
    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    text = client.get("/metrics").text
    for name in ["pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                 "pagedllm:kv_cache_usage_perc", "pagedllm:prompt_tokens_total",
                 "pagedllm:generation_tokens_total", "pagedllm:request_success_total",
                 "pagedllm:num_preemptions_total", "pagedllm:prefix_cache_queries_total",
                 "pagedllm:prefix_cache_hits_total", "pagedllm:time_to_first_token_seconds",
                 "pagedllm:inter_token_latency_seconds", "pagedllm:e2e_request_latency_seconds",
                 "pagedllm:request_queue_time_seconds"]:
        assert name in text, name
    assert 'finished_reason="length"' in text


def test_two_apps_one_process(engine):
    a = build_app(engine, make_args())
    b = build_app(engine, make_args())
    assert a.state.prometheus.registry is not b.state.prometheus.registry


def test_custom_chat_template(engine, tmp_path):
    p = tmp_path / "t.jinja"
    p.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    app = build_app(engine, make_args(chat_template=str(p)))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "yo"}],
                                                 "max_tokens": 1})
        assert r.status_code == 200
        assert engine.received[-1][0]["prompt"] == "[user]yo[assistant]"


def test_client_disconnect_aborts(engine):
    """Drive the ASGI app directly; the client disconnects after the first SSE chunk."""
    slow = FakeAsyncLLM(max_model_len=256, step_delay=0.05)
    app = build_app(slow, make_args())

    async def run(stream: bool):
        body = json.dumps({"prompt": "Hello", "max_tokens": 200, "stream": stream}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"host", b"testserver")],
                 "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}
        sent = []
        disconnect = asyncio.Event()
        state = {"body_sent": False}

        async def receive():
            if not state["body_sent"]:
                state["body_sent"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and msg.get("body"):
                disconnect.set()

        async def disconnect_later():
            await asyncio.sleep(0.3)
            disconnect.set()

        t = asyncio.ensure_future(disconnect_later())
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
        t.cancel()
        return sent

    asyncio.run(run(True))
    assert slow.aborted and not slow.running
    n = len(slow.aborted)
    asyncio.run(run(False))
    assert len(slow.aborted) == n + 1 and not slow.running


@pytest.mark.parametrize("stream", [False, True])
def test_reused_request_id_runs_both_requests(stream):
    """A second request with the X-Request-Id of one still running runs too (its engine id gets a
    random suffix, as vLLM does; both responses keep the client's id), and the first one (streamed
    or not) completes untouched: nothing of it is aborted (the second's cleanup used to abort the
    shared id, and the first then waited forever)."""
    import httpx

    slow = FakeAsyncLLM(max_model_len=256, step_delay=0.02)
    app = build_app(slow, make_args())

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            hdr = {"X-Request-Id": "dup"}
            first = asyncio.ensure_future(c.post("/v1/completions", headers=hdr, json={
                "prompt": "Hello", "max_tokens": 12, "stream": stream}))
            for _ in range(500):
                if "cmpl-dup-0" in slow.running:
                    break
                await asyncio.sleep(0.005)
            assert "cmpl-dup-0" in slow.running
            second = await c.post("/v1/completions", headers=hdr, json={"prompt": "Hi", "max_tokens": 3})
            return await asyncio.wait_for(first, timeout=20), second

    r1, r2 = asyncio.run(run())
    assert r2.status_code == 200 and r2.json()["id"] == "cmpl-dup" and r2.headers["x-request-id"] == "dup"
    assert r2.json()["usage"]["completion_tokens"] == 3
    second_id = slow.received[-1][2]
    assert second_id.startswith("cmpl-dup-0-") and len(second_id) == len("cmpl-dup-0-") + 8
    assert r1.status_code == 200
    if stream:
        events = [e for e in sse_events(r1.text) if e != "[DONE]"]
        assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["id"] == "cmpl-dup"
    else:
        assert r1.json()["choices"][0]["finish_reason"] == "length" and r1.json()["id"] == "cmpl-dup"
        assert r1.json()["usage"]["completion_tokens"] == 12
    assert {"cmpl-dup-0", second_id} <= set(slow.finished_ids) and not slow.aborted and not slow.running


def test_cli_args():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("1000") == 1000
    from pagedllm.config import parse_bytes as config_parse_bytes
    assert config_parse_bytes(4096) == 4096 and config_parse_bytes("1.5G") == 1_500_000_000
    for bad in ("-5", "0", "12XB", "lots"):
        with pytest.raises(ValueError):
            config_parse_bytes(bad)
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--kv-cache-memory", "12XB"])
    args = make_arg_parser().parse_args(["m.gguf", "--kv-cache-memory", "1GiB", "--port", "9",
                                         "--no-enable-prefix-caching",
                                         "--served-model-name", "x", "y",
                                         "--pooler-config", '{"normalize": true}'])
    assert args.model == "m.gguf" and args.kv_cache_memory == 1024**3 and args.port == 9
    assert args.enable_prefix_caching is False and args.served_model_name == ["x", "y"]
    assert args.pooler_config == {"normalize": True}
    d = make_arg_parser().parse_args([])
    assert d.model == "SmolLM2-135M-Instruct" and d.host == "127.0.0.1" and d.port == 8000
    from pagedllm.entrypoints.openai.api_server import engine_args_from_namespace
    ea = engine_args_from_namespace(args)
    assert ea.model == "m.gguf" and ea.kv_cache_memory == 1024**3
    assert ea.enable_prefix_caching is False and ea.served_model_name == ["x", "y"]
    assert ea.kv_cache_dtype == "auto" and d.kv_cache_dtype == "auto"
    ea8 = engine_args_from_namespace(make_arg_parser().parse_args(["--kv-cache-dtype", "fp8"]))
    assert ea8.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):  # argparse rejects names vLLM does not have
        make_arg_parser().parse_args(["--kv-cache-dtype", "int8"])


def test_sagemaker_invocations_route_by_body_and_head_health(client):
    """POST /invocations (SageMaker, as vLLM) runs the route its body is for, streaming included;
    an unknown body is a 400; HEAD /health and /ping answer like GET."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    direct = client.post("/v1/chat/completions", json=chat).json()
    via = client.post("/invocations", json=chat)
    assert via.status_code == 200, via.text
    assert via.json()["object"] == "chat.completion"
    assert via.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    comp = client.post("/invocations", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert comp.json()["object"] == "text_completion" and comp.json()["choices"][0]["text"] == " The quick brown fox jumps"
    streamed = client.post("/invocations", json={**chat, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream") and "data: [DONE]" in streamed.text
    bad = client.post("/invocations", json={"model": MODEL, "max_tokens": 3, "what": 1})
    assert bad.status_code == 400 and "invocations" in bad.json()["error"]["message"]
    # validation errors are the target route's own
    assert_error(client.post("/invocations", json={**chat, "max_tokens": -1}), 400, "max_tokens")
    for path in ("/health", "/ping"):
        assert client.head(path).status_code == 200 == client.get(path).status_code


@pytest.mark.parametrize("body,pooling,path", [
    ({"messages": []}, False, "/v1/chat/completions"), ({"messages": []}, True, "/v1/embeddings"),
    ({"prompt": "x"}, False, "/v1/completions"), ({"input": "x"}, True, "/v1/embeddings"),
    ({"input": "x"}, False, "/v1/responses"), ({"query": "q", "documents": ["d"]}, True, "/rerank"),
    ({"text_1": "a", "text_2": "b"}, True, "/score"), ({"queries": "a", "documents": "b"}, True, "/score"),
    ({"x": 1}, False, None), ([1], False, None), (None, True, None),
])
def test_invocation_path(body, pooling, path):
    from pagedllm.entrypoints.openai.serving_admin import invocation_path
    assert invocation_path(body, pooling) == path


def test_max_completion_tokens_errors_name_it(client):
    """A bad max_completion_tokens is reported under its own name (message and param); a bad
    max_tokens under max_tokens."""
    msgs = [{"role": "user", "content": "hi"}]
    for v in (0, -3):
        e = assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                                                                   "max_completion_tokens": v}), 400,
                         "max_completion_tokens")
        assert e["message"].startswith("max_completion_tokens must be at least 1")
    e = assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 0}),
                     400, "max_tokens")
    assert e["message"].startswith("max_tokens must be at least 1")


def test_responses_output_text_logprobs(client):
    """/v1/responses with include ["message.output_text.logprobs"] (and top_logprobs) returns
    the output tokens' logprobs on the output_text part, as chat completions gives them; without
    the include, an empty list."""
    from openai.types.responses import Response

    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    r = client.post("/v1/responses", json={**body, "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    assert r.status_code == 200, r.text
    part = Response.model_validate(r.json()).output[0].content[0]
    assert len(part.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 4, "temperature": 0, "logprobs": True,
                                                     "top_logprobs": 2}).json()
    assert [lp.logprob for lp in part.logprobs] == [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]]
    plain = client.post("/v1/responses", json=body).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []
