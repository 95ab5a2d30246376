"""The Ollama-compatible routes of a real ``pagedllm serve`` (SmolLM2, a subprocess) through the
official ``ollama`` Python client, unchanged: chat (streamed and not) gives the same greedy text
as /v1/chat/completions, generate, options.num_predict (eval_count), format "json" and a JSON
schema (the output parses and validates), context round trip, tags / show / ps / version, and
Ollama-shaped errors."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import serve

pytestmark = pytest.mark.slow
ollama = pytest.importorskip("ollama")

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def server():
    with serve([MODEL, "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(256 * 1024**2),
                "--max-num-batched-tokens", "256", "--disable-log-stats", "--disable-log-requests"]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server, timeout=300)


def test_chat_matches_the_openai_route(client, server):
    r = client.chat(model=MODEL, messages=MSGS, options=GREEDY)
    assert r.done is True and r.done_reason in ("stop", "length") and r.message.role == "assistant"
    assert "Paris" in r.message.content
    oa = httpx.post(server + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": MSGS, "temperature": 0, "max_tokens": 24}).json()
    assert r.message.content == oa["choices"][0]["message"]["content"]
    assert r.eval_count == oa["usage"]["completion_tokens"]
    assert r.prompt_eval_count == oa["usage"]["prompt_tokens"]
    assert r.eval_duration > 0 and r.total_duration >= r.prompt_eval_duration + r.eval_duration - 10**7
    # streamed: the same text in pieces, the counts on the last one
    parts = list(client.chat(model=MODEL + ":latest", messages=MSGS, options=GREEDY, stream=True))
    assert len(parts) > 3 and all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == r.done_reason
    assert parts[-1].model == MODEL + ":latest"


def test_generate_num_predict_and_context(client):
    for n in (1, 5, 12):
        g = client.generate(model=MODEL, prompt="Count from 1 to 100, separated by commas.",
                            options={"temperature": 0, "num_predict": n})
        assert g.eval_count == n and g.done_reason == "length", (n, g.response)
        assert g.response
    g = client.generate(model=MODEL, prompt="My name is Ada. Say hello to me.", system="You are terse.",
                        options=GREEDY)
    assert g.context and g.prompt_eval_count < len(g.context) <= g.prompt_eval_count + g.eval_count
    g2 = client.generate(model=MODEL, prompt="What is my name?", context=g.context, options=GREEDY)
    alone = client.generate(model=MODEL, prompt="What is my name?", options={"temperature": 0, "num_predict": 1})
    # the earlier conversation's tokens came first in the prompt
    assert g2.prompt_eval_count == len(g.context) + alone.prompt_eval_count
    assert list(g2.context[:len(g.context)]) == list(g.context)
    parts = list(client.generate(model=MODEL, prompt="Count from 1 to 100, separated by commas.",
                                 options={"temperature": 0, "num_predict": 8}, stream=True))
    assert parts[-1].done and parts[-1].eval_count == 8 and "".join(p.response for p in parts)


def test_format_json_and_schema(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON with keys city and "
                                                                     "country."}],
                    format="json", options={"temperature": 0, "num_predict": 200})
    assert r.done_reason == "stop", r.message.content
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"age": {"type": "integer"}, "available": {"type": "boolean"}},
              "required": ["age", "available"], "additionalProperties": False}
    g = client.generate(model=MODEL, prompt="Ollama is 22 years old and busy saving the world. Respond using JSON.",
                        format=schema, options={"temperature": 0, "num_predict": 100})
    assert g.done_reason == "stop", g.response
    jsonschema.validate(json.loads(g.response), schema)


def test_metadata(client, server):
    (m,) = client.list().models
    assert m.model == MODEL + ":latest" and m.details.format == "gguf" and m.details.family == "llama"
    assert m.details.quantization_level == "Q4_1" and m.size > 50_000_000
    show = client.show(MODEL)
    assert show.capabilities == ["completion"] and show.modelinfo["llama.context_length"] == 1024
    assert "<|im_start|>" in show.template
    (p,) = client.ps().models
    assert p.model == MODEL + ":latest" and p.context_length == 1024
    assert httpx.get(server + "/api/version").json() == {"version": "0.9.0"}
    assert httpx.head(server + "/").status_code == 200
    assert httpx.get(server + "/").text == "Ollama is running"


def test_errors_keep_the_server_serving(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=MSGS)
    assert e.value.status_code == 404 and "llama3.2" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input="hello")
    assert e.value.status_code == 400 and "--runner pooling" in e.value.error
    # over the context: cut to max_model_len - 1 (the first 4 tokens and the latest), as Ollama;
    # with "truncate": false, a 400
    r = client.generate(model=MODEL, prompt="word " * 1100, options={"num_predict": 1})
    assert r.done and r.prompt_eval_count == 1023 and r.eval_count == 1 and r.done_reason in ("stop", "length")
    bad = httpx.post(server + "/api/generate", timeout=60,
                     json={"model": MODEL, "prompt": "word " * 1100, "truncate": False})
    assert bad.status_code == 400 and "context length" in bad.json()["error"]
    assert client.chat(model=MODEL, messages=MSGS, options={"num_predict": 2}).eval_count == 2


def _metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == f"pagedllm:{name}" and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_closing_a_stream_aborts_the_request(server):
    import time

    before = _metric(server, "request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Count from 1 to 1000, one number per line.",
            "options": {"temperature": 0, "num_predict": 900}}
    with httpx.stream("POST", server + "/api/generate", json=body, timeout=300) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = r.iter_lines()
        got = [json.loads(next(lines)) for _ in range(5)]
    assert all(g["done"] is False and "response" in g for g in got)
    deadline = time.time() + 10
    while _metric(server, "request_success_total", finished_reason="abort") != before + 1:
        assert time.time() < deadline, "the server did not abort the request of the closed stream"
        time.sleep(0.1)
    assert _metric(server, "num_requests_running") == 0
