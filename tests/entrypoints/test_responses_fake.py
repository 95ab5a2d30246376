"""/v1/responses (OpenAI Responses API) on a scripted fake engine: items in and out, function
calls, reasoning items, the typed event stream (checked with the openai SDK's types and its
stream accumulator), store / previous_response_id / GET / DELETE, the store's bound, background
+ cancel, and bad input."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scripted_engine import ScriptedAsyncLLM  # noqa: E402
from api_helpers import TEMPLATE, TWO_CALLS, assert_error, has_structured_outputs, make_args  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
FN_WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                               "unit": {"type": "string"}},
                             "required": ["city"]}}
FN_TIME = {"type": "function", "name": "get_time",
           "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}


class Box:
    script = "Hello there!"


BOX = Box()


@pytest.fixture(scope="module")
def engine():
    return ScriptedAsyncLLM(lambda prompt: BOX.script, max_model_len=1024)


@pytest.fixture(scope="module")
def client(engine):
    app = build_app(engine, make_args(chat_template=TEMPLATE, enable_auto_tool_choice=True,
                                      tool_call_parser="hermes", reasoning_parser="qwen3",
                                      responses_store_size=3))
    with TestClient(app) as c:
        yield c


def create(client, script, **body):
    BOX.script = script
    return client.post("/v1/responses", json={"model": MODEL, **body})


def validate(body):
    from openai.types.responses import Response
    return Response.model_validate(body)


def parse_events(text):
    """SSE blocks ``event: T`` / ``data: {...}`` -> SDK event objects (type checked)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = json.loads(lines[1][len("data: "):])
        assert data["type"] == lines[0][len("event: "):]
        events.append(adapter.validate_python(data))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def accumulate(events, tools=()):
    """Feed the events to the SDK's Responses stream accumulator (it asserts consistency)."""
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState

    state = ResponseStreamState(input_tools=list(tools) or omit, text_format=omit)
    for e in events:
        state.handle_event(e)
    return state._completed_response


def test_text_input(client, engine):
    r = create(client, "Hello there!", input="Hi!", instructions="Be brief.",
               max_output_tokens=50)
    assert r.status_code == 200, r.text
    resp = validate(r.json())
    assert resp.status == "completed" and resp.object == "response"
    assert resp.id.startswith("resp_") and resp.output_text == "Hello there!"
    (msg,) = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert resp.usage.output_tokens == len(engine.tokenizer.encode("Hello there!",
                                                                   add_special_tokens=False))
    assert resp.usage.input_tokens == len(engine.received[-1][0]["prompt_token_ids"])
    prompt = engine.received[-1][0]["prompt"]
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "user\nHi!" in prompt
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 50


def test_function_calls(client):
    r = create(client, TWO_CALLS, input="Weather and time in Paris?",
               tools=[FN_WEATHER, FN_TIME])
    resp = validate(r.json())
    kinds = [o.type for o in resp.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert resp.output[0].content[0].text == "Let me check."
    calls = resp.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "Europe/Paris"})]
    assert all(c.call_id and c.id.startswith("fc_") and c.status == "completed" for c in calls)


def test_stream_events_and_equivalence(client):
    ref = validate(create(client, TWO_CALLS, input="Weather?", tools=[FN_WEATHER, FN_TIME]).json())
    r = create(client, TWO_CALLS, input="Weather?", tools=[FN_WEATHER, FN_TIME], stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_events(r.text)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert types[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.output_text.delta", "response.output_text.delta"]
    assert types.count("response.output_item.added") == 3 == types.count(
        "response.output_item.done")
    assert types.count("response.function_call_arguments.done") == 2
    final = accumulate(events, [FN_WEATHER, FN_TIME])
    assert final.status == "completed"
    got = [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in final.output]
    want = [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in ref.output]
    assert got == want
    assert final.output[0].content[0].text == ref.output[0].content[0].text
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == ref.output[1].arguments + ref.output[2].arguments


def test_reasoning_item_streamed_and_not(client):
    script = "<think>Weigh options.</think>Answer: 7."
    resp = validate(create(client, script, input="Think, then answer.").json())
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Weigh options." and resp.output_text == "Answer: 7."
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    events = parse_events(create(client, script, input="Think.", stream=True).text)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "Weigh options."
    final = accumulate(events)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[1].content[0].text == "Answer: 7."


def test_round_trip_items_are_rendered(client, engine):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather",
              "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call_output", "call_id": "call_9", "output": "21 C"}]
    resp = validate(create(client, "It is 21 C.", input=items, tools=[FN_WEATHER]).json())
    assert resp.output_text == "It is 21 C."
    prompt = engine.received[-1][0]["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt


def test_store_previous_response_get_delete(client, engine):
    first = validate(create(client, "Nice to meet you, Ada.", input="I am Ada.").json())
    got = client.get(f"/v1/responses/{first.id}")
    assert got.status_code == 200 and validate(got.json()).output_text == first.output_text
    second = validate(create(client, "You are Ada.", input="Who am I?",
                             previous_response_id=first.id).json())
    assert second.previous_response_id == first.id
    prompt = engine.received[-1][0]["prompt"]
    assert prompt.index("I am Ada.") < prompt.index("Nice to meet you, Ada.") < prompt.index(
        "Who am I?")
    off = validate(create(client, "x", input="unstored", store=False).json())
    assert_error(client.get(f"/v1/responses/{off.id}"), 404)
    d = client.delete(f"/v1/responses/{first.id}")
    assert d.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    assert_error(client.get(f"/v1/responses/{first.id}"), 404)
    assert_error(create(client, "x", input="x", previous_response_id="resp_missing"), 404,
                 "previous_response_id")


def test_store_is_bounded_and_counted(client):
    ids = [validate(create(client, f"r{i}", input=f"q{i}").json()).id for i in range(5)]
    # size 3: the two oldest were evicted
    assert [client.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 404, 200, 200, 200]
    metrics = client.get("/metrics").text
    assert 'pagedllm:responses_store_entries{model_name="SmolLM2-135M-Instruct"} 3.0' in metrics
    ev = [l for l in metrics.splitlines() if l.startswith("pagedllm:responses_store_evictions_total")]
    assert ev and float(ev[0].split()[-1]) >= 2


def test_background_and_cancel(engine):
    slow = ScriptedAsyncLLM(lambda p: "word " * 300, max_model_len=2048, step_delay=0.02)
    with TestClient(build_app(slow, make_args(chat_template=TEMPLATE))) as c:
        r = c.post("/v1/responses", json={"model": MODEL, "input": "go", "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued"
        rid = r.json()["id"]
        deadline = time.time() + 10
        while c.get(f"/v1/responses/{rid}").json()["status"] == "queued" and time.time() < deadline:
            time.sleep(0.02)
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
        cancelled = c.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert validate(c.get(f"/v1/responses/{rid}").json()).status == "cancelled"
        assert rid in slow.aborted
        # a quick one completes, and can't be cancelled afterwards
        fast = ScriptedAsyncLLM(lambda p: "done", max_model_len=512)
    with TestClient(build_app(fast, make_args(chat_template=TEMPLATE))) as c:
        rid = c.post("/v1/responses", json={"model": MODEL, "input": "go",
                                            "background": True}).json()["id"]
        deadline = time.time() + 10
        while c.get(f"/v1/responses/{rid}").json()["status"] != "completed" and time.time() < deadline:
            time.sleep(0.02)
        assert validate(c.get(f"/v1/responses/{rid}").json()).output_text == "done"
        assert_error(c.post(f"/v1/responses/{rid}/cancel"), 400)
        fg = c.post("/v1/responses", json={"model": MODEL, "input": "go"}).json()["id"]
        assert "background" in assert_error(c.post(f"/v1/responses/{fg}/cancel"), 400)["message"]


def test_max_output_tokens_is_incomplete(client):
    resp = validate(create(client, "one two three four five six", input="count",
                           max_output_tokens=2).json())
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    events = parse_events(create(client, "one two three four", input="count", max_output_tokens=2,
                                 stream=True).text)
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("body,status,param,needle", [
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input",
     "call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input", "output"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "item_reference"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input", "input_image"),
    ({"input": []}, 400, None, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "function tools"),
    ({"input": "hi", "tools": [FN_WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice", "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "objec"}}}}, 400, "text", "schema"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text", "yaml"),
    ({"input": "hi", "background": True, "store": False}, 400, None, "store"),
])
def test_bad_input(client, body, status, param, needle):
    err = assert_error(create(client, "x", **body), status, param)
    assert needle in err["message"], err
    assert create(client, "ok", input="still serving").status_code == 200


def test_text_format_json_schema(client, engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = create(client, '{"n": 3}', input="n?", text={"format": {"type": "json_schema",
                                                                "name": "n", "schema": schema}})
    if not has_structured_outputs():
        assert "structured outputs" in assert_error(r, 400, "text")["message"]
        return
    assert r.status_code == 200
    assert engine.received[-1][1].structured_outputs.json == schema
    assert json.loads(validate(r.json()).output_text) == {"n": 3}


def test_a_call_cut_by_max_output_tokens_streams_as_incomplete(client):
    """max_output_tokens ends the output inside a hermes call: the streamed function_call item
    is "incomplete" (as the response), and its raw text is not streamed again as a message."""
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    r = create(client, script, input="Weather?", tools=[FN_WEATHER], stream=True, max_output_tokens=20)
    events = parse_events(r.text)
    done = [e for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete"
    calls = [e.item for e in done if e.item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "incomplete"
    msgs = [e.item for e in done if e.item.type == "message"]
    assert all("<tool_call>" not in c.text and "get_weather" not in c.text for m in msgs for c in m.content), msgs
    # the whole call: completed
    events = parse_events(create(client, script, input="Weather?", tools=[FN_WEATHER], stream=True).text)
    calls = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert calls[0].status == "completed" and json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}


def test_input_items_list_and_pages(client):
    """GET /v1/responses/{id}/input_items: the items that led to a stored response (after
    previous_response_id: the conversation before it too) as the API's item objects (checked with
    the openai SDK's ResponseItem type), newest first by default, paged with limit / after."""
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseItem)
    first = validate(create(client, "Nice to meet you, Ada.", input="I am Ada.").json())
    second = validate(create(client, "You are Ada.", input="Who am I?", previous_response_id=first.id).json())
    r = client.get(f"/v1/responses/{second.id}/input_items")
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["object"] == "list" and page["has_more"] is False
    items = [adapter.validate_python(x) for x in page["data"]]
    texts = [x.content[0].text for x in items]
    assert texts == ["Who am I?", "Nice to meet you, Ada.", "I am Ada."]  # newest first
    assert [x.role for x in items] == ["user", "assistant", "user"]
    assert items[1].id == first.output[0].id  # the stored output message keeps its id
    assert page["first_id"] == items[0].id and page["last_id"] == items[-1].id
    assert len({x.id for x in items}) == 3
    again = client.get(f"/v1/responses/{second.id}/input_items").json()
    assert [x["id"] for x in again["data"]] == [x.id for x in items]  # ids are stable
    asc = client.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc"}).json()
    assert [x["id"] for x in asc["data"]] == [x.id for x in reversed(items)]
    # pages of one: has_more until the last, `after` continues
    got, after = [], None
    while True:
        params = {"limit": 1, **({"after": after} if after else {})}
        p = client.get(f"/v1/responses/{second.id}/input_items", params=params).json()
        got += [x["id"] for x in p["data"]]
        after = p["last_id"]
        if not p["has_more"]:
            break
    assert got == [x.id for x in items]
    assert_error(client.get(f"/v1/responses/{second.id}/input_items", params={"limit": 0}), 400, "limit")
    assert_error(client.get(f"/v1/responses/{second.id}/input_items", params={"limit": 101}), 400, "limit")
    assert_error(client.get(f"/v1/responses/{second.id}/input_items", params={"order": "up"}), 400, "order")
    assert_error(client.get(f"/v1/responses/{second.id}/input_items", params={"after": "msg_nope"}), 400, "after")
    assert_error(client.get("/v1/responses/resp_missing/input_items"), 404)
    # function calls and their outputs come back as the SDK's item types, with ids
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call_output", "call_id": "call_9", "output": "21 C"}]
    third = validate(create(client, "It is 21 C.", input=items, tools=[FN_WEATHER]).json())
    listed = client.get(f"/v1/responses/{third.id}/input_items", params={"order": "asc"}).json()["data"]
    typed = [adapter.validate_python(x) for x in listed]
    assert [x.type for x in typed] == ["message", "function_call", "function_call_output"]
    assert typed[0].content[0].type == "input_text" and typed[2].output == "21 C" and all(x.id for x in typed)
