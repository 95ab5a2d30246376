"""Both grammar backends on SmolLM2's real tokenizer (converted from GGUF): whatever a walk through
the bitmasks produces satisfies an independent reference (Python ``re``, membership, a hand
parse, ``jsonschema``); EOS is allowed only where the grammar may end; rollback restores the
state; bad constraints are ValueErrors naming the field."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from so_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB, allowed_ids, random_walk
from pagedllm.structured_output.backend import GrammarSpec

BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module")
def backends(smollm2_tokenizer):
    from pagedllm.structured_output.guidance_backend import GuidanceBackend
    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
    return {"xgrammar": XgrammarBackend(smollm2_tokenizer, SMOLLM2_VOCAB, SMOLLM2_EOS),
            "guidance": GuidanceBackend(smollm2_tokenizer, SMOLLM2_VOCAB, SMOLLM2_EOS)}


def walks(backend, spec, tok, n=12, seed=0, eos_bias=0.0, max_steps=64):
    """Texts of ``n`` random walks through the grammar that ended with EOS."""
    compiled = backend.compile(spec)
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        ids, ended = random_walk(compiled.new_matcher(), SMOLLM2_VOCAB, SMOLLM2_EOS, rng,
                                 max_steps=max_steps, eos_bias=eos_bias)
        if ended:
            texts.append(tok.decode(ids))
    assert len(texts) >= n // 2, "too few walks ended"
    return texts


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_walks_fullmatch(backends, smollm2_tokenizer, name):
    pattern = r"[a-c]{2,4}-[0-9]{2}(x|yz)?"  # [0-9]: llguidance's \d is Unicode-wide (Nd)
    for text in walks(backends[name], GrammarSpec("regex", pattern), smollm2_tokenizer, eos_bias=0.5):
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("name", BACKENDS)
def test_choice_walks_are_members(backends, smollm2_tokenizer, name):
    choices = ["yes", "no", "maybe so", 'a "quoted" \\ word', "ünïcode ✓"]
    seen = set()
    for text in walks(backends[name], GrammarSpec("choice", json.dumps(choices)), smollm2_tokenizer, n=40):
        assert text in choices, text
        seen.add(text)
    assert len(seen) >= 3  # the walks reach several of them


@pytest.mark.parametrize("name,grammar", [
    ("xgrammar", 'root ::= "The answer is " ("yes" | "no") "." | "n=" [0-9] [0-9]?'),
    ("guidance", 'root ::= "The answer is " ("yes" | "no") "." | "n=" [0-9] [0-9]?'),
    ("xgrammar", 'start: "The answer is " ("yes" | "no") "." | "n=" /[0-9]{1,2}/'),
    ("guidance", 'start: "The answer is " ("yes" | "no") "." | "n=" /[0-9]{1,2}/'),
])
def test_ebnf_and_lark_grammars(backends, smollm2_tokenizer, name, grammar):
    for text in walks(backends[name], GrammarSpec("grammar", grammar), smollm2_tokenizer, eos_bias=0.5):
        assert re.fullmatch(r"The answer is (yes|no)\.|n=[0-9]{1,2}", text), text


SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "items": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3}},
          "required": ["ok", "color", "items"]}


@pytest.mark.parametrize("name", BACKENDS)
def test_json_schema_walks_validate(backends, smollm2_tokenizer, name):
    # Compact JSON (no free whitespace) keeps the random walks short; every walk validates.
    spec = GrammarSpec("json", json.dumps(SCHEMA), any_whitespace=False)
    texts = walks(backends[name], spec, smollm2_tokenizer, n=12, max_steps=80, eos_bias=0.5)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("name", BACKENDS)
def test_json_document_tokens_allowed_and_eos_only_at_the_end(backends, smollm2_tokenizer, name):
    tok = smollm2_tokenizer
    doc = '{"ok": true, "color": "green", "items": [3, 1]}'
    ids = tok.encode(doc, add_special_tokens=False)
    m = backends[name].compile(GrammarSpec("json", json.dumps(SCHEMA))).new_matcher()
    bad_start = tok.encode("}", add_special_tokens=False)[0]
    assert bad_start not in allowed_ids(m, SMOLLM2_VOCAB)
    for i, t in enumerate(ids):
        allowed = allowed_ids(m, SMOLLM2_VOCAB)
        assert t in allowed, (i, tok.decode([t]))
        assert SMOLLM2_EOS not in allowed  # the object is not closed yet
        assert m.accept_tokens([t])
    assert SMOLLM2_EOS in allowed_ids(m, SMOLLM2_VOCAB)
    assert not m.accept_tokens([bad_start])  # nothing may follow the closed object but EOS
    assert m.accept_tokens([SMOLLM2_EOS]) and m.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_json_object_allows_any_object(backends, smollm2_tokenizer, name):
    m = backends[name].compile(GrammarSpec("json_object", "")).new_matcher()
    ids = smollm2_tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False)
    assert m.accept_tokens(ids) and SMOLLM2_EOS in allowed_ids(m, SMOLLM2_VOCAB)
    m2 = backends[name].compile(GrammarSpec("json_object", "")).new_matcher()
    assert not m2.accept_tokens(smollm2_tokenizer.encode("[1]", add_special_tokens=False))


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_restores_the_mask(backends, smollm2_tokenizer, name):
    m = backends[name].compile(GrammarSpec("regex", r"ab(c|d)+e")).new_matcher()
    start = allowed_ids(m, SMOLLM2_VOCAB)
    ids = smollm2_tokenizer.encode("abcdd", add_special_tokens=False)
    assert m.accept_tokens(ids[:1])
    after_one = allowed_ids(m, SMOLLM2_VOCAB)
    assert m.accept_tokens(ids[1:])
    m.rollback(len(ids) - 1)
    assert allowed_ids(m, SMOLLM2_VOCAB) == after_one
    m.rollback(1)
    assert allowed_ids(m, SMOLLM2_VOCAB) == start
    m.reset()
    assert allowed_ids(m, SMOLLM2_VOCAB) == start


@pytest.mark.parametrize("name,spec,words", [
    ("xgrammar", GrammarSpec("regex", "(?<=a)b"), ["structured_outputs.regex", "Lookbehind"]),
    ("guidance", GrammarSpec("regex", "(?<=a)b"), ["structured_outputs.regex", "look-around"]),
    ("xgrammar", GrammarSpec("json", '{"type": "object", "properties": 3}'), ["structured_outputs.json"]),
    ("guidance", GrammarSpec("json", '{"type": "nonsense"}'), ["structured_outputs.json"]),
    ("xgrammar", GrammarSpec("grammar", 'root ::= "a" |'), ["structured_outputs.grammar"]),
    ("guidance", GrammarSpec("grammar", "start: undefined_rule"), ["structured_outputs.grammar"]),
    ("xgrammar", GrammarSpec("json", "{}", whitespace_pattern=" *"), ["whitespace_pattern"]),
    ("guidance", GrammarSpec("structural_tag", '{"type": "structural_tag"}'), ["structural_tag"]),
])
def test_bad_constraints_are_value_errors_naming_the_field(backends, name, spec, words):
    with pytest.raises(ValueError) as e:
        backends[name].compile(spec)
    for w in words:
        assert w in str(e.value)
    assert "/project/cpp" not in str(e.value)  # no C++ source locations for clients


def test_guidance_whitespace_pattern_and_unicode_regex(backends, smollm2_tokenizer):
    # Two things only llguidance does (the "auto" backend falls back to it for them).
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"]}
    # additional_properties=False: llguidance follows JSON Schema (extra keys allowed) unless told.
    spec = GrammarSpec("json", json.dumps(schema), whitespace_pattern="", additional_properties=False)
    for text in walks(backends["guidance"], spec, smollm2_tokenizer, n=6, eos_bias=0.5):
        assert not any(c.isspace() for c in text), text
        jsonschema.validate(json.loads(text), schema)
    for text in walks(backends["guidance"], GrammarSpec("regex", r"\p{L}{2,3}"), smollm2_tokenizer,
                      n=8, eos_bias=0.5):
        assert re.fullmatch(r"[^\W\d_]{2,3}", text), text


def test_xgrammar_structural_tag(backends, smollm2_tokenizer):
    tag = {"type": "structural_tag",
           "structures": [{"begin": "<fn>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                        "required": ["x"]}, "end": "</fn>"}],
           "triggers": ["<fn>"]}
    m = backends["xgrammar"].compile(GrammarSpec("structural_tag", json.dumps(tag))).new_matcher()
    text = 'Calling: <fn>{"x": 4}</fn> done'
    assert m.accept_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False))
    m2 = backends["xgrammar"].compile(GrammarSpec("structural_tag", json.dumps(tag))).new_matcher()
    assert not m2.accept_tokens(smollm2_tokenizer.encode('<fn>{"y": 4}', add_special_tokens=False))


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_gemma3_tokenizer(gemma3_path, name):
    """Gemma 3's SentencePiece-style vocabulary (262,144 ids, EOS 1) works with both backends."""
    from pagedllm.loader.tokenizer import load_tokenizer
    from pagedllm.structured_output.guidance_backend import GuidanceBackend
    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
    tok = load_tokenizer(gemma3_path)
    vocab, eos = 262144, 1
    backend = (XgrammarBackend if name == "xgrammar" else GuidanceBackend)(tok, vocab, eos)
    rng = random.Random(0)
    choices = ["sí", "no", "quizás"]
    compiled = backend.compile(GrammarSpec("choice", json.dumps(choices)))
    for _ in range(6):
        ids, ended = random_walk(compiled.new_matcher(), vocab, eos, rng)
        assert ended and tok.decode(ids) in choices
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    compiled = backend.compile(GrammarSpec("json", json.dumps(schema), any_whitespace=False))
    ids, ended = random_walk(compiled.new_matcher(), vocab, eos, rng, eos_bias=0.5)
    assert ended
    jsonschema.validate(json.loads(tok.decode(ids)), schema)


@pytest.mark.parametrize("name", BACKENDS)
def test_end_of_grammar_waits_for_eos(backends, smollm2_tokenizer, name):
    """Both backends end a grammar the same way: after its last real token only EOS is allowed
    and the grammar is not yet terminated (llguidance's "stopped" is not the end); EOS ends it;
    rolling the EOS back (llguidance keeps no rollback entry for it) returns to the EOS-only
    state, and one more step back to the last digit's choice."""
    m = backends[name].compile(GrammarSpec("regex", "[0-9]{3}")).new_matcher()
    ids = smollm2_tokenizer.encode("123", add_special_tokens=False)
    assert len(ids) == 3 and m.accept_tokens(ids)
    assert not m.is_terminated(), "the last digit is a real token, not the end"
    assert allowed_ids(m, SMOLLM2_VOCAB) == [SMOLLM2_EOS]
    assert m.accept_tokens([SMOLLM2_EOS]) and m.is_terminated()
    assert not m.accept_tokens([SMOLLM2_EOS]), "nothing after the end"
    m.rollback(1)
    assert not m.is_terminated() and allowed_ids(m, SMOLLM2_VOCAB) == [SMOLLM2_EOS]
    m.rollback(1)
    digits = allowed_ids(m, SMOLLM2_VOCAB)
    assert ids[2] in digits and SMOLLM2_EOS not in digits and len(digits) == 10
    assert m.accept_tokens([ids[2], SMOLLM2_EOS]) and m.is_terminated()
    m.reset()
    assert not m.is_terminated() and SMOLLM2_EOS not in allowed_ids(m, SMOLLM2_VOCAB)
