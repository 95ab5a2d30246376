"""Tool calling and reasoning through /v1/chat/completions, on a scripted fake engine (the
model's text is given): parsing, streaming deltas, finish reasons, history rendering and bad
input. Responses are checked with the openai SDK's own types and stream accumulator."""
from __future__ import annotations

import json
import os
import sys

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scripted_engine import ScriptedAsyncLLM  # noqa: E402
from api_helpers import MODEL, TEMPLATE, TWO_CALLS, assert_error, has_structured_outputs, make_args, sse_events  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string",
                                                              "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
REASONED = ("<think>\nThe user asks about <tool_call> syntax; no call needed.\n</think>\n\n"
            "Just answer: 42.")
MSGS = [{"role": "user", "content": "Weather and time in Paris?"}]


class Box:
    """The script the engine plays next (tests set ``box.script``)."""

    script = TWO_CALLS


BOX = Box()


@pytest.fixture(scope="module")
def engine():
    return ScriptedAsyncLLM(lambda prompt: BOX.script, max_model_len=1024)


def _client(engine, **kw):
    return TestClient(build_app(engine, make_args(chat_template=TEMPLATE, **kw)))


@pytest.fixture(scope="module")
def plain(engine):
    with _client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def hermes(engine):
    with _client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as c:
        yield c


@pytest.fixture(scope="module")
def reasoning(engine):
    with _client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                 reasoning_parser="deepseek_r1") as c:
        yield c


def chat(client, script, **body):
    BOX.script = script
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 200, **body}
    return client.post("/v1/chat/completions", json=body)


def accumulate(events):
    """Rebuild the streamed message with the openai SDK's own stream accumulator."""
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for e in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(e))
    return state.get_final_completion()


def test_auto_tool_choice_needs_the_flags(plain):
    r = chat(plain, TWO_CALLS, tools=[WEATHER_TOOL])  # tools without tool_choice = "auto"
    err = assert_error(r, 400, "tool_choice")
    assert "--enable-auto-tool-choice" in err["message"] and "--tool-call-parser" in err["message"]
    r = chat(plain, TWO_CALLS, tools=[WEATHER_TOOL], tool_choice="auto")
    assert_error(r, 400, "tool_choice")
    # tool_choice "none": the tools reach the template, the text is not parsed
    r = chat(plain, TWO_CALLS, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.status_code == 200
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == TWO_CALLS and msg["tool_calls"] == []
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_auto_non_streamed(hermes, engine):
    from openai.types.chat import ChatCompletion

    r = chat(hermes, TWO_CALLS, tools=[WEATHER_TOOL, TIME_TOOL])
    assert r.status_code == 200, r.text
    resp = ChatCompletion.model_validate(r.json())
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "Europe/Paris"})]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    prompt = engine.received[-1][0]["prompt"]
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # tools rendered


def test_auto_streamed_equals_non_streamed(hermes):
    ref = chat(hermes, TWO_CALLS, tools=[WEATHER_TOOL, TIME_TOOL]).json()["choices"][0]
    r = chat(hermes, TWO_CALLS, tools=[WEATHER_TOOL, TIME_TOOL], stream=True)
    events = sse_events(r.text)
    final = accumulate(events)
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert msg.content == ref["message"]["content"]
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in ref["message"]["tool_calls"]]
    frags = [tc for e in events for ch in e["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert all(len(ch["delta"].get("tool_calls", [])) <= 1 for e in events for ch in e["choices"])
    # name first (with id and type), then argument fragments; several per call
    firsts = [f for f in frags if "id" in f]
    assert [(f["index"], f["function"]["name"]) for f in firsts] == [(0, "get_weather"),
                                                                      (1, "get_time")]
    assert all(f["type"] == "function" and f["function"]["arguments"] == "" for f in firsts)
    assert sum(1 for f in frags if "id" not in f) > 4
    finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_auto_plain_answer_is_content(hermes):
    text = "Paris is sunny today. <tool> is not a tag I use."
    r = chat(hermes, text, tools=[WEATHER_TOOL])
    c = r.json()["choices"][0]
    assert c["message"]["content"] == text and c["message"]["tool_calls"] == []
    assert c["finish_reason"] == "stop"
    r = chat(hermes, text, tools=[WEATHER_TOOL], stream=True)
    final = accumulate(sse_events(r.text))
    assert final.choices[0].message.content == text
    assert final.choices[0].finish_reason == "stop"


def test_malformed_call_is_content(hermes):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    c = chat(hermes, bad, tools=[WEATHER_TOOL]).json()["choices"][0]
    assert c["message"]["content"] == bad and c["message"]["tool_calls"] == []
    assert c["finish_reason"] == "stop"


def test_parallel_tool_calls_false(hermes):
    c = chat(hermes, TWO_CALLS, tools=[WEATHER_TOOL, TIME_TOOL],
             parallel_tool_calls=False).json()["choices"][0]
    assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["get_weather"]


def test_n_choices_are_parsed_independently(hermes):
    r = chat(hermes, TWO_CALLS, tools=[WEATHER_TOOL, TIME_TOOL], n=2, stream=True)
    events = sse_events(r.text)
    for i in range(2):
        names = [tc["function"]["name"] for e in events for ch in e["choices"] if ch["index"] == i
                 for tc in ch["delta"].get("tool_calls", []) if "id" in tc]
        assert names == ["get_weather", "get_time"]


def test_reasoning_is_split_and_never_parsed_for_tools(reasoning):
    r = chat(reasoning, REASONED, tools=[WEATHER_TOOL])
    m = r.json()["choices"][0]["message"]
    assert m["reasoning_content"] == m["reasoning"] == ("\nThe user asks about <tool_call> "
                                                        "syntax; no call needed.\n")
    assert m["content"] == "\n\nJust answer: 42." and m["tool_calls"] == []
    events = sse_events(chat(reasoning, REASONED, tools=[WEATHER_TOOL], stream=True).text)
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning_content"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == m["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == m["content"]
    # reasoning then a call: the call is found in the content only
    script = "<think>I'll use get_weather.</think>" + TWO_CALLS
    m = chat(reasoning, script, tools=[WEATHER_TOOL, TIME_TOOL]).json()["choices"][0]["message"]
    assert m["reasoning"] == "I'll use get_weather." and len(m["tool_calls"]) == 2
    # include_reasoning=false drops it (still not in the content)
    m = chat(reasoning, REASONED, include_reasoning=False).json()["choices"][0]["message"]
    assert m["reasoning_content"] is None and m["content"] == "\n\nJust answer: 42."


def test_stream_that_ends_inside_reasoning(reasoning):
    script = "<think>\nLong thoughts that never"
    c = chat(reasoning, script).json()["choices"][0]
    assert c["message"]["reasoning_content"] == "\nLong thoughts that never"
    assert c["message"]["content"] is None
    events = sse_events(chat(reasoning, script, stream=True).text)
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == script[len("<think>"):]
    assert not "".join(d.get("content") or "" for d in deltas)


def test_history_with_tool_calls_and_results_is_rendered(hermes, engine):
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    r = chat(hermes, "It is 22 C and sunny in Paris.", messages=msgs, tools=[WEATHER_TOOL])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is 22 C and sunny in Paris."
    prompt = engine.received[-1][0]["prompt"]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in prompt)
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt


@pytest.mark.parametrize("body,param,needle", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function"}}, "tool_choice",
     "Correct usage"),
    ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], "tool_choice": "none"},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "required": "a"}}}], "tool_choice": "none"}, "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "two tools"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only \"function\""),
    ({"messages": MSGS + [{"role": "tool", "content": "22 C"}]}, "messages", "tool_call_id"),
    ({"messages": MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages", "not valid JSON"),
    ({"messages": MSGS + [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages",
     "tool_calls[0]"),
])
def test_bad_tool_input_is_400_and_server_keeps_serving(hermes, body, param, needle):
    err = assert_error(chat(hermes, TWO_CALLS, **body), 400, param)
    assert needle in err["message"], err
    assert chat(hermes, "fine").status_code == 200


def test_server_flags_are_checked():
    from pagedllm.entrypoints.openai.cli_args import resolve_parsers
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        resolve_parsers(make_args(enable_auto_tool_choice=True))
    with pytest.raises(ValueError, match="available: .*hermes"):
        resolve_parsers(make_args(enable_auto_tool_choice=True, tool_call_parser="hermez"))
    with pytest.raises(ValueError, match="available: .*deepseek_r1"):
        resolve_parsers(make_args(reasoning_parser="r1"))


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_forced_choice_is_constrained_or_refused(hermes, engine, tool_choice):
    script = ('[{"name": "get_time", "parameters": {"tz": "UTC"}}]' if tool_choice == "required"
              else '{"tz": "UTC"}')
    r = chat(hermes, script, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice)
    if not has_structured_outputs():
        err = assert_error(r, 400, "tool_choice")
        assert "structured outputs" in err["message"]
        return
    assert r.status_code == 200, r.text
    sp = engine.received[-1][1]
    schema = sp.structured_outputs.json
    if tool_choice == "required":
        assert schema["type"] == "array" and schema["minItems"] == 1
        names = [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]]
        assert names == [["get_weather"], ["get_time"]]
    else:
        assert schema == TIME_TOOL["function"]["parameters"]
    c = r.json()["choices"][0]
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(
        call["function"]["arguments"]) == {"tz": "UTC"}
    assert c["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")


def test_forced_choice_compile_error_names_tools(hermes, engine):
    """A forced tool choice's grammar comes from ``tools``: when it cannot be compiled (here a
    dangling ``$ref`` in a tool's parameters; the engine raises "structured_outputs.json: ..."),
    the 400 names ``tools``, not ``structured_outputs`` (a field the request does not have)."""
    if not has_structured_outputs():
        pytest.skip("no structured outputs in this build")
    from pagedllm.entrypoints.openai.errors import value_error_to_openai

    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    r = chat(hermes, '{"a": 1}', tools=[bad_tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert r.status_code == 200, r.text  # (the scripted engine compiles no grammar)
    so = engine.received[-1][1].structured_outputs
    assert so._source == "tools"
    engine_error = ValueError(f"structured_outputs.{so.kind}: xgrammar cannot compile it: bad $ref")
    err = value_error_to_openai(so.rename_error(engine_error))
    assert err.param == "tools" and err.message.startswith("tools: "), (err.param, err.message)
