"""Input errors name their request field where they are raised (``InputValidationError.param``),
so the server's 400 body carries it without reading the message."""
from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.errors import value_error_to_openai
from pagedllm.inputs import InputValidationError
from pagedllm.sampling_params import SamplingParams, validate_logprobs


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=0), "n"), (dict(top_p=2.0), "top_p"), (dict(temperature=-1.0), "temperature"),
    (dict(presence_penalty="x"), "presence_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(logit_bias={"a": 1}), "logit_bias"), (dict(seed=2**64), "seed"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(temperature=float("inf")), "temperature"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_sampling_params_errors_carry_param(kwargs, param):
    with pytest.raises(InputValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    err = value_error_to_openai(info.value)
    assert (err.status_code, err.param, err.message) == (400, param, str(info.value))


def test_max_logprobs_cap_names_the_field():
    with pytest.raises(InputValidationError) as info:
        validate_logprobs(SamplingParams(prompt_logprobs=7), 5)
    assert info.value.param == "prompt_logprobs"
    assert "Requested prompt_logprobs of 7" in str(info.value)


def test_input_processor_reexports_the_same_class():
    from pagedllm.engine.input_processor import InputValidationError as FromProcessor
    assert FromProcessor is InputValidationError and issubclass(InputValidationError, ValueError)


def test_non_finite_values_are_400s_over_http():
    """Infinity (JSON's non-standard literal, which Python's json and pydantic read) as a
    temperature or repetition penalty, and a NaN logit bias, are 400s naming the field; a bias
    past +-100 is clamped (OpenAI's range, as vLLM does) and a NaN length penalty is refused."""
    import json
    import os
    import sys

    from fastapi.testclient import TestClient

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from api_helpers import assert_error, make_args
    from fake_engine import FakeAsyncLLM

    from pagedllm.entrypoints.openai.api_server import build_app

    engine = FakeAsyncLLM()
    with TestClient(build_app(engine, make_args())) as c:
        def post(extra):
            body = json.dumps({"prompt": "hi", "max_tokens": 2, **extra}, allow_nan=True)
            return c.post("/v1/completions", content=body, headers={"content-type": "application/json"})

        assert_error(post({"temperature": float("inf")}), 400, "temperature")
        assert_error(post({"repetition_penalty": float("inf")}), 400, "repetition_penalty")
        assert "NaN" in assert_error(post({"logit_bias": {"5": float("nan")}}), 400, "logit_bias")["message"]
        assert assert_error(post({"use_beam_search": True, "n": 2, "length_penalty": float("nan")}), 400,
                            "length_penalty")
        assert post({"logit_bias": {"5": 500}}).status_code == 200
        assert engine.received[-1][1].logit_bias == {5: 100.0}


def test_whole_body_errors_say_what_is_wrong():
    """A body that is empty, not a JSON object, or sent without a JSON Content-Type (curl -d) gets
    a 400 that says so (FastAPI's own message spoke of a missing field / "a valid dictionary")."""
    import os
    import sys

    from fastapi.testclient import TestClient

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from api_helpers import assert_error, make_args
    from fake_engine import FakeAsyncLLM

    from pagedllm.entrypoints.openai.api_server import build_app

    with TestClient(build_app(FakeAsyncLLM(), make_args())) as c:
        js = {"content-type": "application/json"}
        assert "empty" in assert_error(c.post("/v1/chat/completions"), 400)["message"]
        assert "empty" in assert_error(c.post("/v1/completions", content=b"", headers=js), 400)["message"]
        assert "must be a JSON object" in assert_error(
            c.post("/v1/completions", content=b"[1, 2]", headers=js), 400)["message"]
        form = {"content-type": "application/x-www-form-urlencoded"}
        msg = assert_error(c.post("/v1/completions", content=b'{"prompt": "hi"}', headers=form), 400)["message"]
        assert "Content-Type: application/json" in msg and "x-www-form-urlencoded" in msg
        # a field's error still names the field
        assert_error(c.post("/v1/chat/completions", json={"messages": "x"}), 400, "messages")


def test_undecodable_image_message_names_the_field_not_an_object_repr():
    """Bytes Pillow cannot identify: the 400 names the field and the formats, not Pillow's message
    (which is the repr of the in-memory buffer, an address)."""
    import base64

    from pagedllm.multimodal.media import decode_base64_image, decode_image

    with pytest.raises(InputValidationError) as info:
        decode_image(b"definitely not an image", "images[0]")
    msg = str(info.value)
    assert info.value.param == "images[0]" and msg.startswith("images[0]: cannot decode the image")
    assert "PNG" in msg and "BytesIO" not in msg and "0x" not in msg
    with pytest.raises(InputValidationError, match="PNG"):
        decode_base64_image(base64.b64encode(b"\x00" * 64).decode(), "messages[0].images[0]")


def test_stream_deltas_carry_only_their_fields():
    """Chat stream chunks' ``delta`` as OpenAI and vLLM send it: the role chunk has role and an
    empty content, a text chunk only content, a tool-call chunk only tool_calls (no nulls, no
    empty list)."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionResponseStreamChoice, DeltaMessage

    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    assert DeltaMessage(content="Hi").model_dump_json() == '{"content":"Hi"}'
    assert DeltaMessage(tool_calls=[{"index": 0}]).model_dump() == {"tool_calls": [{"index": 0}]}
    assert DeltaMessage(reasoning_content="r", reasoning="r").model_dump() == {"reasoning_content": "r",
                                                                              "reasoning": "r"}
    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="x"), finish_reason=None)
    assert choice.model_dump()["delta"] == {"content": "x"} and choice.model_dump()["finish_reason"] is None


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "system", "content": None}])
def test_message_without_content_is_a_400(message):
    """A user / system / developer / tool message needs content (OpenAI and vLLM refuse it); an
    assistant message with tool calls may have none."""
    from pagedllm.engine.chat import normalize_messages

    with pytest.raises(InputValidationError, match=r"messages\[0\]\.content") as info:
        normalize_messages([message], None)
    assert info.value.param == "messages"
    ok = normalize_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": []}], None)
    assert ok[1]["content"] == ""


def test_union_bodies_name_the_field_of_the_form_sent():
    """/tokenize takes chat messages or a prompt: a bad field of the prompt form names that field
    (not a "messages: Field required" of the other form); a union of list types reads "a valid
    list" once."""
    import os
    import sys

    from fastapi.testclient import TestClient

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from api_helpers import assert_error, make_args
    from fake_engine import FakeAsyncLLM

    from pagedllm.entrypoints.openai.api_server import build_app

    with TestClient(build_app(FakeAsyncLLM(), make_args())) as c:
        e = assert_error(c.post("/tokenize", json={"prompt": "hi", "add_special_tokens": "maybe"}), 400,
                         "add_special_tokens")
        assert "messages" not in e["message"]
        assert_error(c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                               "add_generation_prompt": "maybe"}), 400, "add_generation_prompt")
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["count"] >= 1
        e = assert_error(c.post("/v1/completions", json={"prompt": 5}), 400, "prompt")
        assert e["message"].count("a valid list") == 1


@pytest.mark.parametrize("kwargs,param", [
    (dict(stop=5), "stop"), (dict(stop=[1, 2]), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[1, "a"]), "stop_token_ids"),
])
def test_wrong_types_of_stop_fields_name_them(kwargs, param):
    with pytest.raises(InputValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_bad_words_string_is_one_word():
    assert SamplingParams(bad_words="Paris").bad_words == ["Paris"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


@pytest.mark.parametrize("kwargs,field", [
    (dict(gpu_memory_utilization=5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization"),
    (dict(num_threads=0), "num_threads"), (dict(num_threads=-3), "num_threads"), (dict(seed="x"), "seed"),
])
def test_engine_args_check_what_the_cli_checks(kwargs, field):
    """LLM(...) / EngineArgs refuse what `pagedllm serve` refuses, naming the argument."""
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match=f"^{field}: "):
        EngineArgs(model="m", **kwargs)
    EngineArgs(model="m", seed=None, num_threads=None, gpu_memory_utilization=1.0)
