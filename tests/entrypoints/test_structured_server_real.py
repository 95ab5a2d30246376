"""Structured outputs through the real server (SmolLM2, a subprocess) and the ``openai`` client:
``response_format`` json_schema validates with ``jsonschema``; streamed text equals the
non-streamed text for the same seed; bad constraints are 400s with a clear message while the
server keeps serving; /metrics counts compiles and cache hits."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_helpers import serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
        "climate": {"enum": ["temperate", "tropical", "arid", "polar"]},
    },
    "required": ["city", "country", "population_millions", "landmarks", "climate"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def server():
    with serve([MODEL, "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(256 * 1024**2),
                "--max-num-batched-tokens", "256", "--disable-log-stats", "--disable-log-requests",
                "--structured-outputs-config", '{"backend": "auto", "grammar_cache_size": 64}']) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_response_format_validates(client):
    for seed in (0, 1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_stream_equals_non_stream_for_the_same_seed(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=200, temperature=1.0, seed=7,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    # NOTE: the prompt's blocks are cached first, so that both compared requests reuse them: a
    # prefill from the prefix cache and a full one give logits a rounding apart, which at
    # temperature 1 can pick another token (the test failed when it ran first on its worker)
    client.chat.completions.create(**{**kw, "max_tokens": 1})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # Completions with a regex (vLLM's extra field), streamed and not.
    kw = dict(model=MODEL, prompt="My phone number is ", max_tokens=30, temperature=1.0, seed=3,
              extra_body={"structured_outputs": {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}})
    client.completions.create(**{**kw, "max_tokens": 1})
    text = client.completions.create(**kw).choices[0].text
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", text), text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == text


def test_guided_choice_and_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                       max_tokens=5, extra_body={"guided_choice": ["yes", "no"]}, n=3, seed=1)
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       max_tokens=300, temperature=0, response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}},
     "response_format", "properties"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "look"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, body, param, words):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    for stream in (False, True):
        r = httpx.post(server + "/v1/chat/completions", json={**payload, "stream": stream}, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words.lower() in err["message"].lower(), err
        assert err["type"] == "BadRequestError" and err["code"] == 400
    ok = httpx.post(server + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "guided_choice": ["fine"]}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_metrics_count_compiles_and_hits(server, client):
    bad = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                        "guided_regex": "(?<=x)y"}, timeout=120)
    assert bad.status_code == 400
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Pick: ", max_tokens=3,
                                  extra_body={"guided_choice": ["red", "blue", "green"]})
    text = httpx.get(server + "/metrics", timeout=30).text

    def value(name):
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        assert m, name
        return float(m.group(1))
    assert value("pagedllm:structured_output_cache_queries_total") >= 2
    assert value("pagedllm:structured_output_cache_hits_total") >= 1
    assert value("pagedllm:structured_output_compile_seconds_count") >= 1
    assert value("pagedllm:structured_output_compile_failures_total") >= 1
    assert 1 <= value("pagedllm:structured_output_cache_entries") <= value("pagedllm:structured_output_cache_capacity") == 64
