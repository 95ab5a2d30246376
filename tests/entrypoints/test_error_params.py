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
