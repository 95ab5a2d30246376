"""Protocol details (issue 16 part 4) against the fake engine: stream_options, X-Request-Id,
the developer role, unknown-field warnings, CLI flags and vLLM metric names."""
from __future__ import annotations

import logging
import os
import sys

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeAsyncLLM  # noqa: E402
from api_helpers import make_args, sse_events  # noqa: E402



CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2, "stream": True}
COMPLETION = {"prompt": "Hello", "max_tokens": 3, "n": 2, "stream": True}


# ----------------------------------------------------------------------------- stream_options
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("options,final_usage,every_chunk", [
    (None, False, False),
    ({}, False, False),                                   # present but empty: no usage (OpenAI)
    ({"include_usage": False}, False, False),
    ({"include_usage": None}, False, False),
    ({"continuous_usage_stats": True}, False, False),     # only together with include_usage
    ({"include_usage": True}, True, False),
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),
])
def test_stream_usage_only_when_asked(client, path, body, options, final_usage, every_chunk):
    req = dict(body)
    if options is not None:
        req["stream_options"] = options
    events = sse_events(client.post(path, json=req).text)
    with_usage = [e for e in events if e.get("usage") is not None]
    if not final_usage:
        assert with_usage == [] and all("usage" not in e for e in events)
        return
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    if every_chunk:
        assert with_usage == events
    else:
        assert with_usage == [events[-1]]
        # OpenAI: with include_usage every other chunk carries "usage": null
        assert all("usage" in e and e["usage"] is None for e in events[:-1])


# ----------------------------------------------------------------------------- X-Request-Id
def test_request_id_header_echoed_or_generated(client, engine):
    h = {"X-Request-Id": "client-id-42"}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2}, headers=h)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-42"
    assert r.json()["id"] == "chatcmpl-client-id-42"       # the client's id is the request's id
    assert engine.received[-1][2] == "chatcmpl-client-id-42"
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True},
                    headers={"X-Request-Id": "s-1"})
    assert r.headers["x-request-id"] == "s-1"
    assert {e["id"] for e in sse_events(r.text)} == {"cmpl-s-1"}
    assert engine.received[-1][2] == "cmpl-s-1-0"
    # no client id: the header carries the id the server gave the request (the body's id)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2})
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("chatcmpl-")
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True})
    assert r.headers["x-request-id"] == sse_events(r.text)[0]["id"]
    # the body's request_id names the request when no header does
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "request_id": "body-7"})
    assert r.json()["id"] == "cmpl-body-7" and r.headers["x-request-id"] == "cmpl-body-7"
    # every response, errors and other routes included
    r = client.get("/v1/models", headers=h)
    assert r.headers["x-request-id"] == "client-id-42"
    assert len(client.get("/v1/models").headers["x-request-id"]) >= 16
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": -1}, headers=h)
    assert r.status_code == 400 and r.headers["x-request-id"] == "client-id-42"
    r = client.post("/v1/embeddings", json={"input": "hi"}, headers=h)  # pooling router, 400 here
    assert r.headers["x-request-id"] == "client-id-42"


def test_request_id_header_can_be_disabled(engine):
    with TestClient(build_app(engine, make_args(enable_request_id_headers=False))) as c:
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1},
                   headers={"X-Request-Id": "x"})
        assert r.status_code == 200 and "x-request-id" not in r.headers


# ----------------------------------------------------------------------------- developer role
def _tokenize(client, role, **extra):
    r = client.post("/tokenize", json={"messages": [{"role": role, "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}], **extra})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_developer_role_is_system_for_templates_without_it(client, engine):
    sys_ids = _tokenize(client, "system")
    assert _tokenize(client, "developer") == sys_ids
    # SmolLM2's template does not know the role: rendered as is, it adds its default system
    # prompt and an unknown turn (the bug: 18 tokens here become 40)
    tok = engine.tokenizer
    raw = tok.apply_chat_template([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in raw
    assert (len(sys_ids), len(tok.encode(raw, add_special_tokens=False))) == (18, 40)
    for role in ("system", "developer"):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(sys_ids)
        assert engine.received[-1][0]["prompt_token_ids"] == sys_ids
    # a template that knows the role gets it unchanged
    tmpl = ("{% for m in messages %}{% if m.role == 'developer' %}[DEV]{% else %}[{{ m.role }}]{% endif %}"
            "{{ m.content }}{% endfor %}")
    text = engine.tokenizer.decode(_tokenize(client, "developer", chat_template=tmpl))
    assert text.startswith("[DEV]Be brief.") and "[system]" not in text


def test_offline_chat_template_maps_developer(engine):
    """The offline path (LLM.chat renders through pagedllm.engine.chat.apply_chat_template)."""
    from pagedllm.engine.chat import apply_chat_template

    def render(role, template=None):
        return apply_chat_template(engine.tokenizer, [{"role": role, "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}], template)
    assert render("developer") == render("system")
    assert "You are a helpful AI assistant" not in render("developer")
    tmpl = "{% for m in messages %}<{{ m.role }}>{% endfor %}{# developer-aware #}"
    assert render("developer", tmpl) == "<developer><user>"


# ----------------------------------------------------------------------------- unknown fields
def test_unknown_request_fields_are_logged(client, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.entrypoints.openai"):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi", "colour": "red"}], "max_tokens": 1,
            "temprature": 0.5, "top_kk": 3})
        assert r.status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "stream": True,
                                                 "stream_options": {"include_usage": True, "foo": 1}})
        assert r.status_code == 200
        client.post("/v1/embeddings", json={"input": "hi", "normalise": False})
    msgs = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert any("ChatCompletionRequest" in m and "['temprature', 'top_kk']" in m for m in msgs), msgs
    assert any("ChatMessageParam" in m and "['colour']" in m for m in msgs), msgs
    assert any("StreamOptions" in m and "['foo']" in m for m in msgs), msgs
    assert any("EmbeddingRequest" in m and "['normalise']" in m for m in msgs), msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.entrypoints.openai"):
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "seed": 3})
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


# ----------------------------------------------------------------------------- CLI
def test_serve_model_and_tokenizer_flags(caplog):
    from pagedllm.entrypoints.openai.api_server import engine_args_from_namespace
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser, normalize_args

    p = make_arg_parser()
    ea = engine_args_from_namespace(p.parse_args(["--model", "m.gguf", "--tokenizer", "tokdir"]))
    assert (ea.model, ea.tokenizer) == ("m.gguf", "tokdir")
    ea = engine_args_from_namespace(p.parse_args(["m.gguf"]))
    assert (ea.model, ea.tokenizer) == ("m.gguf", None)
    with caplog.at_level(logging.WARNING):
        args = normalize_args(p.parse_args(["pos.gguf", "--model", "opt.gguf"]))
    assert args.model == "pos.gguf" and "pos.gguf" in caplog.text and "opt.gguf" in caplog.text
    # naming the default model explicitly is still the positional argument
    assert normalize_args(p.parse_args(["SmolLM2-135M-Instruct", "--model", "o"])).model == "SmolLM2-135M-Instruct"
    assert engine_args_from_namespace(p.parse_args([])).model == "SmolLM2-135M-Instruct"
    # the GemmaDecision recipe's command line parses (--gpu-memory-utilization is CUDA-only, ignored on CPU)
    args = normalize_args(p.parse_args([
        "enc", "--runner", "pooling", "--convert", "embed", "--dtype", "bfloat16", "--pooler-config",
        '{"pooling_type":"LAST","use_activation":false}', "--max-model-len", "3072",
        "--gpu-memory-utilization", "0.20", "--hf-overrides", '{"is_matryoshka": true}']))
    ea = engine_args_from_namespace(args)
    assert ea.pooler_config == {"pooling_type": "LAST", "use_activation": False}
    assert (ea.dtype, ea.max_model_len, ea.gpu_memory_utilization) == ("bfloat16", 3072, 0.2)
    assert ea.hf_overrides == {"is_matryoshka": True}
    assert args.enable_request_id_headers is True and args.metrics_prefix == "pagedllm"
    assert p.parse_args(["--no-enable-request-id-headers"]).enable_request_id_headers is False
    with pytest.raises(SystemExit):
        p.parse_args(["--metrics-prefix", "sglang"])


def test_bench_kv_cache_memory_accepts_sizes():
    from pagedllm.entrypoints.cli import build_parser

    for cmd in ("throughput", "latency", "prefix-caching", "embed"):
        args = build_parser().parse_args(["bench", cmd, "--kv-cache-memory", "64MiB"])
        assert args.kv_cache_memory == 64 * 1024**2, cmd
    assert build_parser().parse_args(["bench", "latency", "--kv-cache-memory", "1000"]).kv_cache_memory == 1000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "latency", "--kv-cache-memory", "64 parsecs"])


def test_apply_hf_overrides():
    from types import SimpleNamespace

    from pagedllm.config import apply_hf_overrides

    cfg = SimpleNamespace(hidden_size=8, rope_parameters={"rope_theta": 10.0, "rope_type": "default"})
    apply_hf_overrides(cfg, '{"is_matryoshka": true, "rope_parameters": {"rope_theta": 20.0}}')
    assert cfg.is_matryoshka is True and cfg.rope_parameters == {"rope_theta": 20.0, "rope_type": "default"}
    assert apply_hf_overrides(cfg, lambda c: SimpleNamespace(x=1)).x == 1
    with pytest.raises(ValueError, match="hf_overrides"):
        apply_hf_overrides(cfg, "[1]")


# ----------------------------------------------------------------------------- metric names
# Every metric vLLM's example Grafana dashboard queries
# (examples/online_serving/prometheus_grafana/grafana.json).
VLLM_DASHBOARD_METRICS = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
    # vLLM v1's current names
    "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_inference_time_seconds_sum",
]


def _series(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]


def test_metrics_prefix_vllm_serves_the_dashboard_names():
    engine = FakeAsyncLLM(max_model_len=256)
    with TestClient(build_app(engine, make_args(metrics_prefix="vllm"))) as c:
        assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}).status_code == 200
        text = c.get("/metrics").text
    for name in VLLM_DASHBOARD_METRICS:
        lines = _series(text, name)
        assert lines and all('model_name="SmolLM2-135M-Instruct"' in ln for ln in lines), name
    assert "pagedllm:" not in text
    gen = float(_series(text, "vllm:generation_tokens_total")[0].split()[-1])
    assert gen == 4.0
    tpot = float(_series(text, "vllm:time_per_output_token_seconds_count")[0].split()[-1])
    itl = float(_series(text, "vllm:inter_token_latency_seconds_count")[0].split()[-1])
    assert tpot == itl == 3.0  # 4 tokens: 3 inter-token gaps, the deprecated name mirrors the current one
    (succ,) = [ln for ln in _series(text, "vllm:request_success_total") if 'finished_reason="length"' in ln]
    assert float(succ.split()[-1]) == 1.0
    engine2 = FakeAsyncLLM(max_model_len=256)
    with TestClient(build_app(engine2, make_args())) as c:  # default: pagedllm names, no deprecated aliases
        text = c.get("/metrics").text
    assert "pagedllm:num_requests_running" in text and "vllm:" not in text
    assert "gpu_cache_usage_perc" not in text and "pagedllm:request_prefill_time_seconds" in text


# ----------------------------------------------------------------------------- issue 37
@pytest.fixture(scope="module")
def tools_client():
    from scripted_engine import ScriptedAsyncLLM
    from api_helpers import TEMPLATE
    engine = ScriptedAsyncLLM(lambda prompt: "<think>Hmm.</think>Plain text.", max_model_len=1024)
    args = make_args(chat_template=TEMPLATE, enable_auto_tool_choice=True,
                     tool_call_parser="hermes", reasoning_parser="qwen3")
    with TestClient(build_app(engine, args)) as c:
        c.engine = engine
        yield c


CHAT_HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": "required"}),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": "required", "tools": []}),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": NAMED}),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": "auto"}),
    ("/v1/responses", {"input": "Hi", "tool_choice": "required"}),
    ("/v1/responses", {"input": "Hi", "tool_choice": {"type": "function", "name": "get_time"}}),
])
def test_forced_tool_choice_without_tools_is_400(tools_client, path, body):
    from api_helpers import assert_error
    err = assert_error(tools_client.post(path, json=body), 400, "tool_choice")
    assert err["message"] == "When using `tool_choice`, `tools` must be set."
    assert err["type"] == "BadRequestError"


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_messages_forced_tool_choice_without_tools_is_400(tools_client, tool_choice):
    r = tools_client.post("/v1/messages", json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "tool_choice": tool_choice,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "When using `tool_choice`, `tools` must be set."}}


def test_unforced_tool_choice_without_tools_still_answers(tools_client):
    r = tools_client.post("/v1/chat/completions", json={**CHAT_HI, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Plain text."
    for tc in (None, "auto", "none"):  # Responses' default tool_choice is "auto"
        body = {"input": "Hi"} if tc is None else {"input": "Hi", "tool_choice": tc}
        r = tools_client.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == "Plain text."
    for tc in ({"type": "auto"}, {"type": "none"}):
        r = tools_client.post("/v1/messages", json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 50, "tool_choice": tc,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["content"][-1]["text"] == "Plain text."


MESSAGES_BASE = {"model": "SmolLM2-135M-Instruct", "max_tokens": 20,
                 "messages": [{"role": "user", "content": "Hi"}]}
TOOL_USE_NO_INPUT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "t", "name": "f"}]}]


@pytest.mark.parametrize("path,body,expect", [
    # the model validator's errors (no location) once started with ": "
    ("/v1/messages", {"max_tokens": 0}, "max_tokens: must be at least 1"),
    ("/v1/messages", {"messages": []}, "messages: at least one message is required"),
    ("/v1/messages", {"temperature": 3}, "temperature: must be between 0 and 1"),
    # a union's member names ("str", "list[dict[str,any]]") are not part of the field path
    ("/v1/messages", {"system": 5}, "system: Input should be a valid string or a valid list"),
    ("/v1/messages", {"max_tokens": "x"}, "max_tokens: Input should be a valid integer, unable to "
                                          "parse string as an integer"),
    ("/v1/messages", {"model": None}, "model: Field required"),
    ("/v1/messages", {"messages": [1]}, "messages.0: Input should be a valid dictionary"),
    ("/v1/messages", {"stop_sequences": "x"}, "stop_sequences: Input should be a valid list"),
    ("/v1/messages", {"tool_choice": "any"}, "tool_choice: Input should be a valid dictionary"),
    ("/v1/messages", {"messages": TOOL_USE_NO_INPUT}, "messages.1.content.0.input: Field required"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text: Field required (a string)"),
    ("/v1/messages", {"system": [{"type": "text"}]}, "system.0.text: Field required (a string)"),
    ("/v1/messages", {"top_p": 2}, "top_p must be in (0, 1], got 2.0."),
    ("/v1/responses", {"input": 5}, "input: Input should be a valid string or a valid list"),
    ("/v1/responses", {"input": [5]},
     "input: Input should be a valid string; input.0: Input should be a valid dictionary"),
    ("/v1/responses", {"input": "x", "tool_choice": 5},
     "tool_choice: Input should be a valid string or a valid dictionary"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "`max_output_tokens` must be at least 1."),
    ("/v1/responses", {"input": "x", "max_output_tokens": "x"},
     "max_output_tokens: Input should be a valid integer, unable to parse string as an integer"),
    ("/v1/responses", {"input": []}, "`input` must not be empty."),
    ("/v1/responses", {"input": "x", "truncation": "x"}, "truncation: Input should be 'auto' or 'disabled'"),
    ("/v1/responses", {"input": "x", "background": True, "store": False},
     "`background` can only be used when `store` is true."),
    ("/v1/responses", {"input": "x", "top_logprobs": 30}, "`top_logprobs` must be between 0 and 20."),
    ("/v1/responses", {"input": "x", "text": 3}, "text: Input should be a valid dictionary"),
    ("/v1/chat/completions", {**CHAT_HI, "stop": 5}, "stop: Input should be a valid string or a valid list"),
])
def test_error_messages_start_with_a_word(tools_client, path, body, expect):
    import re
    if path == "/v1/messages":
        body = {k: v for k, v in {**MESSAGES_BASE, **body}.items() if v is not None}
    r = tools_client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    msg = err["message"]
    # a field name (perhaps `quoted`) or a word first: no stray ": " or other punctuation
    assert re.match(r"`?[A-Za-z]", msg), msg
    assert msg == expect
    if path != "/v1/messages":  # OpenAI bodies name the field
        field = re.match(r"`?([a-z_]+)", expect).group(1)
        assert err["param"] == field, err


def test_format_validation_errors_of_any_model():
    from typing import Optional, Union

    from pydantic import BaseModel, ValidationError, model_validator

    from pagedllm.entrypoints.openai.errors import format_validation_errors

    class M(BaseModel):
        a: Union[int, list[int]]
        b: Optional[dict[str, int]] = None

        @model_validator(mode="after")
        def _check(self):
            if self.a == 0:
                raise ValueError("a: must not be 0")
            return self

    def fmt(data):
        with pytest.raises(ValidationError) as e:
            M.model_validate(data)
        return format_validation_errors(e.value.errors())

    assert fmt({"a": 0}) == ("a: must not be 0", None)  # no location: the message alone
    assert fmt({"a": "x"}) == ("a: Input should be a valid integer, unable to parse string as an "
                               "integer or a valid list", "a")
    assert fmt({"a": [1, "y"], "b": {"k": "z"}}) == (
        "a: Input should be a valid integer; a.1: Input should be a valid integer, unable to parse "
        "string as an integer; b.k: Input should be a valid integer, unable to parse string as an "
        "integer", "a")
    assert fmt({}) == ("a: Field required", "a")


def test_own_reasoning_sent_back_is_accepted_silently(tools_client, caplog):
    r = tools_client.post("/v1/chat/completions", json=CHAT_HI)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Hmm."
    tmpl = ("{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}|{{ m.reasoning }}]"
            "{{ m.content }}{% endfor %}")
    for sent in (message,  # the server's own message, unchanged: both names
                 {"role": "assistant", "content": "Plain text.", "reasoning": "Hmm."},
                 {"role": "assistant", "content": "Plain text.", "reasoning_content": "Hmm."}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedllm.entrypoints.openai"):
            r = tools_client.post("/v1/chat/completions", json={
                **CHAT_HI, "chat_template": tmpl,
                "messages": [{"role": "user", "content": "Hi"}, sent, {"role": "user", "content": "More"}]})
        assert r.status_code == 200, r.text
        assert [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()] == []
        prompt = tools_client.engine.received[-1][0]["prompt"]
        assert prompt == "[user||]Hi[assistant|Hmm.|Hmm.]Plain text.[user||]More"


def test_offline_chat_gets_the_reasoning_under_both_names():
    from pagedllm.engine.chat import normalize_messages
    msgs = [{"role": "user", "content": "Hi", "reasoning": "not an assistant's"},
            {"role": "assistant", "content": "A", "reasoning": "new name"},
            {"role": "assistant", "content": "B", "reasoning_content": "old name"},
            {"role": "assistant", "content": "C", "reasoning": "wins", "reasoning_content": "loses"},
            {"role": "assistant", "content": "D"}]
    out = normalize_messages(msgs)
    assert out[0] == msgs[0]
    assert [(m.get("reasoning"), m.get("reasoning_content")) for m in out[1:]] == [
        ("new name", "new name"), ("old name", "old name"), ("wins", "wins"), (None, None)]
    assert "reasoning_content" not in msgs[1]  # copies: the caller's messages are kept
