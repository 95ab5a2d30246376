"""Structured outputs with a reasoning parser: the reasoning is free (all tokens allowed, the
matcher does not move), the grammar applies from the token after ``</think>`` (in the output,
or already in the prompt), on SmolLM2's real tokenizer and the xgrammar backend."""
from __future__ import annotations

import json

import pytest
import torch

from so_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB, allowed_ids
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import StructuredOutputsParams as SOP

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def manager(tok, **cfg):
    return StructuredOutputManager(tok, SMOLLM2_VOCAB, SMOLLM2_EOS,
                                   dict({"backend": "xgrammar"}, **cfg))


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def row(req):
    bm = torch.full((1, (SMOLLM2_VOCAB + 31) // 32), -1, dtype=torch.int32)
    req.fill_bitmask(bm, 0)
    return bm


def test_reasoning_is_free_then_the_answer_is_constrained(smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = manager(tok, reasoning_parser="deepseek_r1")
    req = m.new_request(SOP(json=SCHEMA), enc(tok, "<|im_start|>assistant\n"))
    req._grammar.result()
    assert not req.reasoning_ended
    thinking = enc(tok, "<think>\nThe answer is not JSON yet, {{[ ]}} at all.")
    for t in thinking:
        assert bool((row(req) == -1).all())  # nothing masked while reasoning
        assert req.accept_tokens([t])
    assert not req.reasoning_ended and req.num_accepted == 0 and not req.is_terminated()
    end = enc(tok, "</think>")
    assert req.accept_tokens(end) and req.reasoning_ended
    assert not bool((row(req) == -1).all())  # the grammar applies now
    answer = enc(tok, json.dumps({"a": 12}))
    assert req.accept_tokens(answer) and req.num_accepted == len(answer)
    assert SMOLLM2_EOS in allowed_ids(req.matcher, SMOLLM2_VOCAB)
    m.shutdown()


def test_answer_tokens_in_the_same_step_as_the_end_are_checked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = manager(tok, reasoning_parser="deepseek_r1")
    req = m.new_request(SOP(json=SCHEMA), [])
    req._grammar.result()
    end_token = enc(tok, "ok</think>")
    bad = enc(tok, "nope")
    assert not req.accept_tokens(end_token + bad)  # "nope" is not JSON: refused
    m.shutdown()


def test_reasoning_ended_in_the_prompt_or_never_started(smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = manager(tok, reasoning_parser="qwen3")
    # Qwen3 with enable_thinking=false: the template closes an empty block in the prompt
    req = m.new_request(SOP(json=SCHEMA), enc(tok, "assistant\n<think>\n\n</think>\n\n"))
    assert req.reasoning_ended
    # no <think> at all: a qwen3-style output that does not think is constrained at once
    assert m.new_request(SOP(json=SCHEMA), enc(tok, "assistant\n")).reasoning_ended
    # deepseek_r1 outputs start inside the reasoning
    r1 = manager(tok, reasoning_parser="deepseek_r1")
    assert not r1.new_request(SOP(json=SCHEMA), enc(tok, "assistant\n")).reasoning_ended
    # enable_in_reasoning: constrained from the start
    both = manager(tok, reasoning_parser="deepseek_r1", enable_in_reasoning=True)
    assert both.new_request(SOP(json=SCHEMA), enc(tok, "assistant\n")).reasoning_ended
    for x in (m, r1, both):
        x.shutdown()


def test_config_names_the_reasoning_parser():
    from pagedllm.structured_output.config import StructuredOutputsConfig
    with pytest.raises(ValueError, match="reasoning_parser.*available"):
        StructuredOutputsConfig.from_any({"reasoning_parser": "nope"})
    assert StructuredOutputsConfig.from_any({"reasoning_parser": "qwen3"}).reasoning_parser == "qwen3"


@pytest.mark.slow
def test_engine_leaves_the_reasoning_free_and_constrains_the_answer():
    """SmolLM2 through ``LLM`` with ``reasoning_parser="deepseek_r1"``: a prompt that leaves the
    model inside the reasoning generates exactly the unconstrained text; once the prompt has
    closed the reasoning the answer follows the schema."""
    import jsonschema

    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=128 * 1024**2,
              max_num_batched_tokens=512, seed=0,
              structured_outputs_config={"reasoning_parser": "deepseek_r1"})
    prompt = ("<|im_start|>user\nDescribe a cat as JSON with a name and an age.<|im_end|>\n"
              "<|im_start|>assistant\n")
    free = SamplingParams(temperature=0, max_tokens=24)
    constrained = SamplingParams(temperature=0, max_tokens=48,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA_CAT))
    (a,), (b,) = (llm.generate(prompt, sp, use_tqdm=False) for sp in (free, constrained))
    assert b.outputs[0].text[:len(a.outputs[0].text)] == a.outputs[0].text
    (c,) = llm.generate(prompt + "<think>\nA cat object.\n</think>\n\n", constrained,
                        use_tqdm=False)
    jsonschema.validate(json.loads(c.outputs[0].text), SCHEMA_CAT)


SCHEMA_CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 30}},
              "required": ["name", "age"], "additionalProperties": False}
