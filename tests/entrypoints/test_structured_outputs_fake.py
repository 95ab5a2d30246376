"""The HTTP surface of structured outputs against the fake engine: ``response_format``,
``structured_outputs`` and the ``guided_*`` fields reach the engine as one
StructuredOutputsParams; malformed or conflicting ones are 400s naming the field."""
from __future__ import annotations

import os
import sys

import pytest

from pagedllm.structured_output.params import StructuredOutputsParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from api_helpers import MODEL, assert_error  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}



def chat(client, **body):
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **body})


def received_so(engine) -> StructuredOutputsParams:
    return engine.received[-1][1].structured_outputs


@pytest.mark.parametrize("body,expect", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_json": '{"type": "integer"}'}, {"json": {"type": "integer"}}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     {"regex": "a+", "disable_any_whitespace": True}),
    # Options from one source, the constraint from another.
    ({"structured_outputs": {"disable_additional_properties": True}, "response_format": {"type": "json_object"}},
     {"json_object": True, "disable_additional_properties": True}),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, {"json": SCHEMA, "whitespace_pattern": " ?"}),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
     {"regex": "a", "disable_any_whitespace": True, "_backend": "xgrammar"}),
])
def test_fields_map_onto_structured_outputs(client, engine, body, expect):
    r = chat(client, **body)
    assert r.status_code == 200, r.text
    so = received_so(engine)
    for k, v in expect.items():
        assert getattr(so, k) == v, k


def test_text_or_nothing_means_unconstrained(client, engine):
    assert chat(client, response_format={"type": "text"}).status_code == 200
    assert received_so(engine) is None
    assert chat(client).status_code == 200
    assert received_so(engine) is None


def test_completions_take_the_same_fields(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                             "guided_choice": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert received_so(engine).choice == ["a", "b"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                             "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and received_so(engine).json_object is True


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["x"]}}, "structured_outputs", "only one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown field"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "one constraint must be set"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "outlines"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar:fast"}, "guided_decoding_backend", "fast"),
])
def test_bad_fields_are_400_naming_the_field(client, engine, body, param, words):
    n = len(engine.received)
    r = chat(client, **body)
    assert_error(r, 400, param)
    assert words in r.json()["error"]["message"]
    assert len(engine.received) == n  # nothing reached the engine
    assert chat(client).status_code == 200  # and the server keeps serving
