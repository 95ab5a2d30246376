"""/v1/messages (Anthropic Messages API) on a scripted fake engine: content blocks in and out,
tool_use / tool_result, thinking, stop reasons, usage, the event stream (checked with the
anthropic SDK's types and its stream accumulator), x-api-key auth, and Anthropic-shaped
errors."""
from __future__ import annotations

import json
import os
import sys

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scripted_engine import ScriptedAsyncLLM  # noqa: E402
from api_helpers import TEMPLATE, TWO_CALLS, has_structured_outputs, make_args  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
KEY = "k-123"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                              "unit": {"type": "string"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object",
                                             "properties": {"tz": {"type": "string"}}}}


class Box:
    script = "Hello!"


BOX = Box()


@pytest.fixture(scope="module")
def engine():
    return ScriptedAsyncLLM(lambda prompt: BOX.script, max_model_len=1024)


@pytest.fixture(scope="module")
def client(engine):
    app = build_app(engine, make_args(chat_template=TEMPLATE, enable_auto_tool_choice=True,
                                      tool_call_parser="hermes", reasoning_parser="qwen3",
                                      api_key=KEY))
    with TestClient(app) as c:
        yield c


def post(client, script, headers=None, **body):
    BOX.script = script
    body = {"model": MODEL, "max_tokens": 200,
            "messages": [{"role": "user", "content": "Hi"}], **body}
    return client.post("/v1/messages", json=body,
                       headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}
                       if headers is None else headers)


def validate(body):
    from anthropic.types import Message
    return Message.model_validate(body)


def events_of(text):
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(RawMessageStreamEvent)
    out = []
    for block in text.strip().split("\n\n"):
        etype, data = block.split("\n")
        assert etype.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == etype[len("event: "):]
        if payload["type"] != "ping":
            out.append(adapter.validate_python(payload))
    return out


def accumulate(events):
    from anthropic.lib.streaming._messages import accumulate_event
    snap, bufs = None, {}
    for e in events:
        snap = accumulate_event(event=e, current_snapshot=snap, json_bufs=bufs)
    return snap


def assert_anthropic_error(r, status, needle=""):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert needle in body["error"]["message"], body
    return body["error"]


def test_text_message(client, engine):
    r = post(client, "Hello!", system="Be nice.", stop_sequences=["\n\n"])
    assert r.status_code == 200, r.text
    m = validate(r.json())
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hello!"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == len(engine.received[-1][0]["prompt_token_ids"])
    assert m.usage.output_tokens == len(engine.tokenizer.encode("Hello!",
                                                                add_special_tokens=False))
    sp = engine.received[-1][1]
    assert sp.stop == ["\n\n"] and sp.max_tokens == 200
    assert "<|im_start|>system\nBe nice.<|im_end|>" in engine.received[-1][0]["prompt"]


def test_tool_use_and_stream(client):
    m = validate(post(client, TWO_CALLS, tools=[WEATHER, TIME]).json())
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    assert m.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in m.content[1:]] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "Europe/Paris"})]
    assert all(b.id.startswith("toolu_") and len(b.id) > 20 for b in m.content[1:])  # Anthropic's id form
    assert len({b.id for b in m.content[1:]}) == 2
    r = post(client, TWO_CALLS, tools=[WEATHER, TIME], stream=True)
    events = events_of(r.text)
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == 3 == types.count("content_block_stop")
    snap = accumulate(events)
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None))
            for b in snap.content] == [(b.type, getattr(b, "name", None),
                                        getattr(b, "input", None)) for b in m.content]
    assert snap.content[0].text == m.content[0].text and snap.stop_reason == "tool_use"
    assert all(b.id.startswith("toolu_") for b in snap.content[1:])
    partials = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                and e.delta.type == "input_json_delta"]
    assert len(partials) > 4


def test_round_trip_blocks_are_rendered(client, engine):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "19 C"}]},
                {"type": "text", "text": "Thanks!"}]}]
    m = validate(post(client, "It is 19 C.", messages=msgs, tools=[WEATHER]).json())
    assert m.content[0].text == "It is 19 C." and m.stop_reason == "end_turn"
    prompt = engine.received[-1][0]["prompt"]
    assert ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            in prompt)
    assert prompt.index("<tool_response>\n19 C\n</tool_response>") < prompt.index("Thanks!")


def test_thinking_blocks(client):
    script = "<think>Consider units.</think>It is warm."
    m = validate(post(client, script).json())
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Consider units." and m.content[1].text == "It is warm."
    snap = accumulate(events_of(post(client, script, stream=True).text))
    assert [b.type for b in snap.content] == ["thinking", "text"]
    assert snap.content[0].thinking == "Consider units." and snap.content[1].text == "It is warm."


def test_stop_reasons(client):
    m = validate(post(client, "one two three four five", max_tokens=2).json())
    assert m.stop_reason == "max_tokens"
    snap = accumulate(events_of(post(client, "one two three", max_tokens=2, stream=True).text))
    assert snap.stop_reason == "max_tokens" and snap.usage.output_tokens == 2


def test_auth_headers(client):
    assert post(client, "hi", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    err = assert_anthropic_error(post(client, "hi", headers={"x-api-key": "wrong"}), 401)
    assert err["type"] == "authentication_error"
    # the OpenAI routes take x-api-key too
    r = client.get("/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 200


def test_count_tokens(client, engine):
    BOX.script = "x"
    r = client.post("/v1/messages/count_tokens", headers={"x-api-key": KEY}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count me"}]})
    assert r.status_code == 200
    post(client, "x", messages=[{"role": "user", "content": "Count me"}])
    assert r.json() == {"input_tokens": len(engine.received[-1][0]["prompt_token_ids"])}


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content: must not be empty"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages.0.content: must not be empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                      "name": "f", "input": [1]}]}]}, "input"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                      "name": "f", "input": None}]}]},
     "messages.0.content.0.input: must be an object"),
    # input is required (Anthropic's schema), not read as {}
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}]}, "messages.1.content.0.input: Field required"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {"type": "objec"}}]}, "JSON schema"),
    ({"model": "other-model"}, "other-model"),
])
def test_bad_input_has_anthropic_shape(client, body, needle):
    status = 404 if "model" in body else 400
    assert_anthropic_error(post(client, "x", **body), status, needle)
    assert post(client, "fine").status_code == 200
    r = client.post("/v1/messages", content=b"{not json", headers={"x-api-key": KEY})
    assert_anthropic_error(r, 400, "Invalid JSON")


def test_forced_tool_choice(client, engine):
    r = post(client, '[{"name": "get_time", "parameters": {"tz": "UTC"}}]', tools=[WEATHER, TIME],
             tool_choice={"type": "any"})
    if not has_structured_outputs():
        assert_anthropic_error(r, 400, "structured outputs")
        return
    m = validate(r.json())
    assert m.stop_reason == "tool_use" and m.content[0].input == {"tz": "UTC"}


def test_usage_counts_prefix_cache_hits_once(client, engine):
    """Anthropic: input_tokens + cache_read_input_tokens (+ cache_creation) is the whole prompt,
    so tokens read from the prefix cache are not in input_tokens too; the same in the stream."""
    engine.num_cached_tokens = 16
    try:
        m = validate(post(client, "Hello!").json())
        whole = len(engine.received[-1][0]["prompt_token_ids"])
        assert m.usage.cache_read_input_tokens == 16 and m.usage.input_tokens == whole - 16 > 0
        events = events_of(post(client, "Hello!", stream=True).text)
        start, delta = events[0], [e for e in events if e.type == "message_delta"][0]
        assert start.message.usage.input_tokens == delta.usage.input_tokens == whole - 16
        assert start.message.usage.cache_read_input_tokens == delta.usage.cache_read_input_tokens == 16
    finally:
        engine.num_cached_tokens = 0


def test_prefill_is_continued(client, engine):
    """A final assistant message is a prefill: the prompt ends inside that turn (no end of turn,
    no new assistant header) and the reply is the continuation only."""
    r = post(client, " Paris.", messages=[{"role": "user", "content": "Capital of France?"},
                                          {"role": "assistant", "content": "The capital is"}])
    m = validate(r.json())
    prompt = engine.received[-1][0]["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe capital is"), prompt[-80:]
    assert [b.text for b in m.content] == [" Paris."]
    # without a prefill the generation prompt opens a new assistant turn
    post(client, "x")
    assert engine.received[-1][0]["prompt"].endswith("<|im_start|>assistant\n")


def test_empty_reply_is_empty_content_both_ways(client):
    """An empty reply is ``content: []`` with and without streaming (Anthropic rejects empty text
    blocks sent back)."""
    m = validate(post(client, "").json())
    assert m.content == [] and m.stop_reason == "end_turn"
    snap = accumulate(events_of(post(client, "", stream=True).text))
    assert snap.content == []


def test_forced_tool_call_cut_by_max_tokens(client, engine):
    """A forced tool call cut short by max_tokens is a 200 with stop_reason max_tokens and the
    arguments parsed as far as they go (not a 400 from a JSON error), streamed or not."""
    if not has_structured_outputs():
        pytest.skip("forced tool choice needs a structured-outputs backend")
    args = '{"city": "Paris", "unit": "C"}'
    r = post(client, args, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=5)
    assert r.status_code == 200, r.text
    m = validate(r.json())
    assert m.stop_reason == "max_tokens"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and isinstance(uses[0].input, dict)
    assert set(uses[0].input) <= {"city", "unit"}
    snap = accumulate(events_of(post(client, args, tools=[WEATHER], stream=True, max_tokens=5,
                                     tool_choice={"type": "tool", "name": "get_weather"}).text))
    assert snap.stop_reason == "max_tokens"
    # a complete call still says tool_use
    m = validate(post(client, args, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).json())
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris", "unit": "C"}


def test_count_tokens_with_tools_needs_no_tool_parser(engine):
    """count_tokens renders the tools into the prompt without a tool-call parser (a server
    started without --enable-auto-tool-choice), and counts the same prompt as a request with
    tool_choice none."""
    app = build_app(engine, make_args(chat_template=TEMPLATE))
    with TestClient(app) as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
        r = c.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200, r.text
        n = r.json()["input_tokens"]
        BOX.script = "x"
        assert c.post("/v1/messages", json={**body, "max_tokens": 4, "tool_choice": {"type": "none"}}).status_code == 200
        assert n == len(engine.received[-1][0]["prompt_token_ids"])
        assert "get_weather" in engine.received[-1][0]["prompt"]
        no_tools = c.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "tools"})
        assert no_tools.json()["input_tokens"] < n


def test_anthropic_sdk_models_list_and_retrieve(client):
    """The anthropic SDK's client.models (it sends anthropic-version) gets Anthropic's shapes;
    an OpenAI client's /v1/models is unchanged."""
    import anthropic

    sdk = anthropic.Anthropic(api_key=KEY, base_url="http://testserver", http_client=client)
    page = sdk.models.list()
    ids = [m.id for m in page.data]
    assert MODEL in ids and all(m.type == "model" and m.display_name and m.created_at for m in page.data)
    m = sdk.models.retrieve(MODEL)
    assert m.id == MODEL and m.type == "model" and m.created_at.year >= 2026
    with pytest.raises(anthropic.NotFoundError):
        sdk.models.retrieve("no-such-model")
    r = client.get("/v1/models", headers={"x-api-key": KEY})
    assert r.json()["object"] == "list" and r.json()["data"][0]["object"] == "model"
