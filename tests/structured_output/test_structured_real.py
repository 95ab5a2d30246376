"""Structured outputs end to end on SmolLM2 through the offline ``LLM``: every kind at
temperature 1 with several seeds yields text a reference accepts (``json`` + ``jsonschema``,
``re.fullmatch``, membership); free rows batched with constrained ones decode exactly as alone;
n > 1, seeds, logprobs and prefix caching; preemption and chunked prefill with a tiny KV cache."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import SamplingParams, StructuredOutputsParams as SOP

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "status": {"enum": ["active", "inactive"]},
    },
    "required": ["name", "age", "address", "tags", "status"],
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
EBNF = 'root ::= "The capital of " city " is " city "." \ncity ::= [A-Z] [a-z]{1,12}'
LARK = 'start: "Answer: " ANSWER "!"\nANSWER: "yes" | "no" | /[0-9]{1,3}/'

PROMPTS = {
    "json": "Describe a person as JSON with name, age, address, tags and status.",
    "json_object": "Give me a small JSON object about a cat.",
    "regex": "What is a US phone number?",
    "choice": "Classify the sentiment: I love this movie!",
    "ebnf": "What is the capital of France?",
    "lark": "Is the sky blue?",
}


def check(kind: str, text: str) -> None:
    """Raise unless ``text`` satisfies the constraint of ``kind`` (independent references)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "ebnf":
        assert re.fullmatch(r"The capital of [A-Z][a-z]{1,12} is [A-Z][a-z]{1,12}\.", text), text
    elif kind == "lark":
        assert re.fullmatch(r"Answer: (yes|no|[0-9]{1,3})!", text), text


def so_for(kind: str) -> SOP:
    return {"json": SOP(json=PERSON), "json_object": SOP(json_object=True), "regex": SOP(regex=PHONE),
            "choice": SOP(choice=CHOICES), "ebnf": SOP(grammar=EBNF), "lark": SOP(grammar=LARK)}[kind]


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_every_kind_validates_at_temperature_one(smollm2_llm):
    kinds = list(PROMPTS)
    seeds = [0, 1, 2]
    convs, params, labels = [], [], []
    for kind in kinds:
        for seed in seeds:
            convs.append(msgs(PROMPTS[kind]))
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=so_for(kind)))
            labels.append(kind)
    outs = smollm2_llm.chat(convs, params, use_tqdm=False)
    stopped = {k: 0 for k in kinds}
    for kind, o in zip(labels, outs):
        c = o.outputs[0]
        if c.finish_reason == "stop":
            check(kind, c.text)
            stopped[kind] += 1
        else:  # only an unbounded grammar (any JSON object) may run out of tokens
            assert kind == "json_object" and c.finish_reason == "length", (kind, c.text)
    assert all(stopped[k] == len(seeds) for k in kinds if k != "json_object"), stopped
    assert stopped["json_object"] >= 1


def test_free_rows_in_a_mixed_batch_match_their_solo_runs(smollm2_llm):
    free = [f"Write one sentence about the number {i}." for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    solo = [smollm2_llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in free]
    kinds = ["json", "regex", "choice", "ebnf"] * 2
    prompts = [PROMPTS[k] for k in kinds] + free
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=200, structured_outputs=so_for(k))
              for i, k in enumerate(kinds)] + [greedy] * 8
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for k, o in zip(kinds, outs[:8]):
        assert o.outputs[0].finish_reason == "stop"
        check(k, o.outputs[0].text)
    assert [o.outputs[0].token_ids for o in outs[8:]] == solo


SMALL = {"type": "object",
         "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120},
                        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
         "required": ["name", "age", "tags"]}


def test_n_seeds_logprobs_and_prefix_cache(smollm2_llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=100, logprobs=2,
                        structured_outputs=SOP(json=SMALL, disable_any_whitespace=True))
    first = smollm2_llm.chat(msgs(PROMPTS["json"]), sp, use_tqdm=False)[0]
    again = smollm2_llm.chat(msgs(PROMPTS["json"]), sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prompt came from the prefix cache
    assert len(first.outputs) == 3
    for a, b in zip(first.outputs, again.outputs):
        assert a.finish_reason == "stop"
        jsonschema.validate(json.loads(a.text), SMALL)
        assert "\n" not in a.text  # disable_any_whitespace: compact JSON
        assert a.token_ids == b.token_ids  # same seed, same tokens
        assert len(a.logprobs) == len(a.token_ids)
        for tok, step in zip(a.token_ids, a.logprobs):
            assert tok in step and len(step) <= 3
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the children differ


def test_preemption_and_chunked_prefill_keep_outputs_valid(monkeypatch):
    from pagedllm import LLM
    from pagedllm.quantization import group_quant as gq

    # float activations: the token-equality check below shows the matcher survived preemption only
    # where the numerics do not depend on chunking; with the default int8 activations a chunk-dependent
    # attention last bit can flip a sampled token (docs/performance.md "Integer-dot GGUF path")
    monkeypatch.setattr(gq, "INTDOT", False)
    # 12 blocks of 16 tokens (float32 SmolLM2: 46,080 bytes/token; one is the null block) for
    # requests of up to ~120 tokens: the scheduler must preempt; 32-token steps split every
    # prompt into chunks.
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=46_080 * 16 * 12,
              max_model_len=176, max_num_batched_tokens=32, enable_prefix_caching=False, seed=0)
    kinds = ["json", "json", "regex", "ebnf"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                             structured_outputs=SOP(json=PERSON, disable_any_whitespace=True)
                             if k == "json" else so_for(k)) for i, k in enumerate(kinds)]
    outs = llm.chat([msgs(PROMPTS[k]) for k in kinds], params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions_total > 0
    for k, o in zip(kinds, outs):
        assert o.outputs[0].finish_reason == "stop", (k, o.outputs[0].text)
        check(k, o.outputs[0].text)
    # The same requests one at a time (no preemption) give the same tokens: a preempted
    # request's matcher kept its place while its KV cache was recomputed.
    alone = [llm.chat(msgs(PROMPTS[k]), p, use_tqdm=False)[0].outputs[0].token_ids
             for k, p in zip(kinds, params)]
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_offline_errors_are_value_errors_naming_the_field(smollm2_llm):
    with pytest.raises(ValueError, match=r"structured_outputs.regex: .*Lookbehind"):
        smollm2_llm.generate("x", SamplingParams(structured_outputs=SOP(regex="(?<=a)b")), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs.json"):
        smollm2_llm.generate("x", SamplingParams(structured_outputs=SOP(json={"type": "object", "properties": 1})),
                             use_tqdm=False)
    # The engine keeps working.
    out = smollm2_llm.generate("x", SamplingParams(max_tokens=3, structured_outputs=SOP(choice=["ok"])),
                               use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def test_min_tokens_gives_way_to_a_finished_constraint(smollm2_llm):
    """min_tokens longer than any string the constraint allows: the constraint wins (the output
    is one of the choices / matches the regex and stops), it is not broken or aborted."""
    for so in (SOP(choice=["yes", "no"]), SOP(regex=r"[0-9]{2}")):
        outs = smollm2_llm.generate(["Say hi.", "Is the sky blue?"],
                                    SamplingParams(max_tokens=16, min_tokens=10, structured_outputs=so, seed=0),
                                    use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop", (so, c.text, c.finish_reason)
            assert (c.text in ("yes", "no")) if so.choice else re.fullmatch(r"[0-9]{2}", c.text), c.text


def test_guidance_backend_keeps_the_last_token():
    """The guidance backend (llguidance) ends a grammar like xgrammar: the request finishes on the
    EOS that follows the grammar's last token, and the text keeps that last token. (It used to
    finish on llguidance's "stopped", right after the last real token, which the output processor
    then cut as if it were the EOS: "SG-23" for a 6-character code, "" for a choice, JSON without
    its closing brace.)"""
    from pagedllm import LLM
    llm = LLM("SmolLM2-135M-Instruct", kv_cache_memory=64 * 1024**2, seed=0,
              structured_outputs_config={"backend": "guidance"})
    eos = llm.get_tokenizer().eos_token_id
    SMALL = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["x"], "additionalProperties": False}
    code = r"\p{Lu}{2}-[0-9]{3}"  # (a Unicode class: what the auto backend sends to guidance)
    cases = [("Code:", SOP(regex=code),  # (\p{Lu}: any uppercase letter, Cyrillic ones too)
              lambda t: len(t) == 6 and t[:2].isupper() and re.fullmatch(r"-[0-9]{3}", t[2:])),
             ("Is the sky blue?", SOP(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
             ("A JSON object with a small integer x:", SOP(json=SMALL),
              lambda t: jsonschema.validate(json.loads(t), SMALL) is None)]
    for prompt, so, ok in cases:
        outs = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so)
                                           for s in range(3)], use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop", (so, c.text)
            assert ok(c.text), (so, c.text)
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1], c.token_ids
            assert llm.get_tokenizer().decode(c.token_ids[:-1]) == c.text
