"""StructuredOutputsParams: vLLM's fields, exactly one constraint, ValueErrors naming the field;
its place on SamplingParams (dict form, clone for n > 1, re-exports)."""
from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams as SOP


def test_one_constraint_and_its_kind():
    assert SOP(json={"type": "object"}).kind == "json"
    assert SOP(json='{"type": "integer"}').json == {"type": "integer"}  # JSON text is parsed
    assert SOP(regex="a+").kind == "regex"
    assert SOP(choice=("a", "b")).choice == ["a", "b"]
    assert SOP(grammar='root ::= "x"').kind == "grammar"
    assert SOP(json_object=True).kind == "json_object"
    assert SOP(structural_tag='{"type": "structural_tag"}').kind == "structural_tag"

    class Model:  # anything with pydantic's model_json_schema()
        @staticmethod
        def model_json_schema():
            return {"type": "object", "properties": {"a": {"type": "string"}}}
    assert SOP(json=Model).json["properties"] == {"a": {"type": "string"}}


@pytest.mark.parametrize("kwargs,message", [
    ({}, "one constraint must be set"),
    ({"json_object": False}, "one constraint must be set"),
    ({"regex": "a", "choice": ["x"]}, "only one kind of constraint"),
    ({"choice": []}, "structured_outputs.choice: the list of choices is empty"),
    ({"choice": "ab"}, "structured_outputs.choice: must be a list"),
    ({"choice": ["a", 1]}, "structured_outputs.choice: every choice must be a string"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"json": [1]}, "structured_outputs.json: must be a JSON object"),
    ({"regex": ""}, "structured_outputs.regex: must be a non-empty string"),
    ({"grammar": "  "}, "structured_outputs.grammar: must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object: must be true"),
    ({"regex": "a", "whitespace_pattern": 3}, "structured_outputs.whitespace_pattern"),
    ({"regex": "a", "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SOP(**kwargs)


def test_from_dict_and_sampling_params():
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+", "disable_any_whitespace": True})
    assert isinstance(sp.structured_outputs, SOP) and sp.structured_outputs.regex == "[0-9]+"
    assert "structured_outputs=StructuredOutputsParams(" in repr(sp)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")
    # n > 1 children get their own copy.
    kid = sp.clone()
    assert kid.structured_outputs == sp.structured_outputs and kid.structured_outputs is not sp.structured_outputs


def test_reexports():
    import pagedllm
    from pagedllm import sampling_params
    assert pagedllm.StructuredOutputsParams is SOP is sampling_params.StructuredOutputsParams


def test_rename_error_names_the_request_field():
    p = SOP(json={"type": "object"})
    assert str(p.rename_error(ValueError("structured_outputs.json: bad"))) == "structured_outputs.json: bad"
    p._source = "response_format"
    assert str(p.rename_error(ValueError("structured_outputs.json: bad"))) == "response_format: bad"
