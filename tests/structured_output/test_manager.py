"""The manager: backend choice ("auto" falls back to llguidance only for what xgrammar refuses),
compiles off the caller's thread, one compile per identical constraint, a cache bounded by
``grammar_cache_size`` (filled past it here), statistics, and the per-step bitmask."""
from __future__ import annotations

import threading

import pytest
import torch

from so_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB
from pagedllm.structured_output import manager as manager_mod
from pagedllm.structured_output.backend import CompiledGrammar, StructuredOutputBackend
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import StructuredOutputsParams as SOP


def make(tok, **cfg):
    return StructuredOutputManager(tok, SMOLLM2_VOCAB, SMOLLM2_EOS, cfg or None)


def test_lru_bound_hits_and_evictions(smollm2_tokenizer):
    m = make(smollm2_tokenizer, grammar_cache_size=2)
    a, b, c = SOP(regex="a+"), SOP(regex="b+"), SOP(regex="c+")
    for p in (a, b, c):
        m.compile(p)
    st = m.stats()
    assert st["structured_output_cache_entries"] == 2 == st["structured_output_cache_capacity"]
    assert st["structured_output_cache_evictions"] == 1
    assert (st["structured_output_cache_queries"], st["structured_output_cache_hits"]) == (3, 0)
    m.compile(c)                       # still cached
    m.compile(a)                       # evicted: compiled again (and b is evicted now)
    st = m.stats()
    assert (st["structured_output_cache_queries"], st["structured_output_cache_hits"]) == (5, 1)
    assert st["structured_output_grammars_compiled"] == 4 and st["structured_output_cache_evictions"] == 2
    assert len(m.pop_compile_seconds()) == 4 and m.pop_compile_seconds() == []
    m.shutdown()


def test_identical_constraints_share_one_compile_and_options_are_part_of_the_key(smollm2_tokenizer):
    m = make(smollm2_tokenizer)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    f1 = m.grammar_future(SOP(json=schema))
    f2 = m.grammar_future(SOP(json=dict(schema)))
    assert f1 is f2
    f3 = m.grammar_future(SOP(json=schema, disable_any_whitespace=True))
    assert f3 is not f1
    f1.result(), f3.result()
    assert m.stats()["structured_output_grammars_compiled"] == 2
    m.shutdown()


class _GatedBackend(StructuredOutputBackend):
    """A backend whose compile waits for a gate (to watch the manager not block on it)."""

    name = "xgrammar"
    gate = threading.Event()
    threads: list[str] = []

    def compile(self, spec):
        type(self).threads.append(threading.current_thread().name)
        assert self.gate.wait(30)

        class C(CompiledGrammar):
            def new_matcher(self):
                raise NotImplementedError
        return C()


def test_compile_runs_on_the_pool_not_the_caller(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(manager_mod, "_make_backend", lambda *a: _GatedBackend(*a[1:]))
    m = make(smollm2_tokenizer, backend="xgrammar")
    fut = m.grammar_future(SOP(regex="slow"))  # returns at once while the compile waits
    req = m.new_request(SOP(regex="slow"))
    assert not fut.done() and not req.is_ready() and req.error() is None
    _GatedBackend.gate.set()
    fut.result(timeout=30)
    assert req.is_ready() and req.error() is None
    assert _GatedBackend.threads == ["pagedllm-grammar_0"]
    m.shutdown()


def test_auto_falls_back_to_guidance_only_when_needed(smollm2_tokenizer):
    m = make(smollm2_tokenizer)
    assert m.compile(SOP(regex="[a-z]+")).backend == "xgrammar"
    # Unicode classes and whitespace_pattern: xgrammar refuses, llguidance compiles.
    assert m.compile(SOP(regex=r"\p{L}+")).backend == "guidance"
    assert m.compile(SOP(json={"type": "object"}, whitespace_pattern=" ?")).backend == "guidance"
    strict = make(smollm2_tokenizer, disable_fallback=True)
    with pytest.raises(ValueError, match=r"structured_outputs.regex: xgrammar"):
        strict.compile(SOP(regex=r"\p{L}+"))
    # A per-request backend (guided_decoding_backend) overrides the engine's.
    p = SOP(regex="[a-z]+")
    p._backend = "guidance"
    assert m.compile(p).backend == "guidance"
    m.shutdown()
    strict.shutdown()


def test_errors_name_the_field_and_are_counted(smollm2_tokenizer):
    m = make(smollm2_tokenizer)
    with pytest.raises(ValueError) as e:
        m.compile(SOP(regex="(?<=a)b"))
    msg = str(e.value)
    assert msg.startswith("structured_outputs.regex: ") and "xgrammar" in msg and "guidance" in msg
    with pytest.raises(ValueError, match="structured_outputs.json"):
        m.compile(SOP(json={"type": "object", "properties": 3}))
    assert m.stats()["structured_output_compile_failures"] == 2
    # A failed compile is cached too: the same bad constraint fails again without recompiling.
    with pytest.raises(ValueError):
        m.compile(SOP(regex="(?<=a)b"))
    assert m.stats()["structured_output_compile_failures"] == 2
    req = m.new_request(SOP(regex="(?<=a)b"))
    assert req.is_ready() and "Lookbehind" in req.error()
    bad = SOP(regex="a")
    bad._backend = "outlines"
    with pytest.raises(ValueError, match="guided_decoding_backend"):
        m.grammar_future(bad)
    m.shutdown()


def test_config_is_validated():
    from pagedllm.structured_output.config import StructuredOutputsConfig as C
    assert C.from_any(None) == C()
    assert C.from_any({"backend": "guidance", "grammar_cache_size": 4}).grammar_cache_size == 4
    for bad, word in [({"backend": "outlines"}, "backend"), ({"cache": 1}, "unknown key"),
                      ({"grammar_cache_size": 0}, "grammar_cache_size"),
                      ({"disable_fallback": "yes"}, "disable_fallback"), ("auto", "must be a dict")]:
        with pytest.raises(ValueError, match=word):
            C.from_any(bad)


def test_bitmask_rows_follow_each_request(smollm2_tokenizer):
    from pagedllm.sample.bitmask import unpack_bitmask
    tok = smollm2_tokenizer
    m = make(smollm2_tokenizer)
    r1, r2 = m.new_request(SOP(choice=["yes", "no"])), m.new_request(SOP(regex="[0-9]"))
    for r in (r1, r2):
        r._grammar.result()
    bm = m.grammar_bitmask([r1, r2])
    assert bm.dtype == torch.int32 and bm.shape == (2, (SMOLLM2_VOCAB + 31) // 32)
    allowed = unpack_bitmask(bm, SMOLLM2_VOCAB)
    assert allowed[0, tok.encode("yes", add_special_tokens=False)[0]]
    assert not allowed[0, tok.encode("7", add_special_tokens=False)[0]]
    assert allowed[1, tok.encode("7", add_special_tokens=False)[0]] and not allowed[1, SMOLLM2_EOS]
    assert r2.accept_tokens(tok.encode("7", add_special_tokens=False))
    allowed = unpack_bitmask(m.grammar_bitmask([r2]), SMOLLM2_VOCAB)[0]
    assert allowed.nonzero().squeeze(1).tolist() == [SMOLLM2_EOS]  # only EOS once complete
    # Rollback (the speculative-decoding hook) goes back to "a digit next".
    r2.rollback(1)
    assert unpack_bitmask(m.grammar_bitmask([r2]), SMOLLM2_VOCAB)[0, tok.encode("3", add_special_tokens=False)[0]]
    m.shutdown()


def test_concurrent_compiles_share_one_compiler(smollm2_tokenizer):
    # Eight distinct constraints in flight at once on four threads (xgrammar's compiler is shared).
    m = make(smollm2_tokenizer, compile_threads=4)
    params = [SOP(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
              for i in range(6)] + [SOP(regex=f"x{{{i}}}") for i in range(1, 3)]
    futs = [m.grammar_future(p) for p in params]
    tok = smollm2_tokenizer
    for i, f in enumerate(futs[:6]):
        matcher = f.result(timeout=120).new_matcher()
        assert matcher.accept_tokens(tok.encode(f'{{"k{i}": 5}}', add_special_tokens=False))
        assert not f.result().new_matcher().accept_tokens(tok.encode(f'{{"k{i + 1}": 5}}', add_special_tokens=False))
    for f in futs:
        f.result(timeout=120)
    assert m.stats()["structured_output_grammars_compiled"] == 8
    m.shutdown()


# (schema, an instance that breaks it): xgrammar 0.2.8 compiles each schema but accepts the instance.
UNENFORCED_BY_XGRAMMAR = [
    ({"type": "object", "properties": {"x": {"type": "integer", "multipleOf": 5, "minimum": 1}},
      "required": ["x"], "additionalProperties": False}, {"x": 8}),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, {"a": 1}),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcdef"),
    ({"$defs": {"I": {"type": "integer"}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/I", "maximum": 3}}, "required": ["x"]}, {"x": 9}),
]


@pytest.mark.parametrize("schema,bad", UNENFORCED_BY_XGRAMMAR)
def test_auto_sends_what_xgrammar_would_not_enforce_to_guidance(smollm2_tokenizer, schema, bad):
    """A schema keyword xgrammar compiles but ignores (multipleOf with bounds, allOf of several
    schemas, a length bound beside a pattern, a constraint beside $ref) goes to llguidance under
    "auto" (vLLM's has_xgrammar_unsupported_json_features rule), whose matcher refuses the
    breaking instance; naming xgrammar explicitly is a ValueError that names the keyword."""
    import json

    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)  # (the instance does break the schema)
    m = make(smollm2_tokenizer)
    compiled = m.compile(SOP(json=schema))
    assert compiled.backend == "guidance"
    ids = smollm2_tokenizer.encode(json.dumps(bad), add_special_tokens=False)
    matcher = compiled.new_matcher()
    assert not (matcher.accept_tokens(ids) and matcher.accept_tokens([SMOLLM2_EOS])), "guidance enforces it"
    explicit = SOP(json=schema)
    explicit._backend = "xgrammar"
    with pytest.raises(ValueError, match=r"structured_outputs.json: the schema uses .* xgrammar backend does not enforce"):
        m.compile(explicit)
    m.shutdown()


def test_what_neither_backend_enforces_is_an_error_and_annotations_are_not(smollm2_tokenizer):
    """uniqueItems / not: neither backend enforces them, so the request fails with a message
    naming the keyword instead of decoding unconstrained by it; what pydantic emits for nested
    models and optional fields ($ref with a description, one-schema allOf, anyOf with null,
    OpenAPI integer formats) stays on xgrammar."""
    from pagedllm.structured_output.xgrammar_backend import unenforced_json_feature

    m = make(smollm2_tokenizer)
    for schema, word in [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                         ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "'not' at properties.x")]:
        with pytest.raises(ValueError) as e:
            m.compile(SOP(json=schema))
        assert str(e.value).startswith("structured_outputs.json: ") and word in str(e.value), str(e.value)
        assert "guidance" in str(e.value)
    pydantic_like = {
        "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string", "title": "City"}},
                           "required": ["city"], "title": "Addr"}},
        "type": "object", "title": "Person",
        "properties": {"addr": {"$ref": "#/$defs/Addr", "description": "where"},
                       "home": {"allOf": [{"$ref": "#/$defs/Addr"}], "default": None},
                       "nick": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}], "default": None},
                       "n": {"type": "integer", "format": "int32", "minimum": 0},
                       "when": {"type": "string", "format": "date-time"}},
        "required": ["addr"]}
    assert unenforced_json_feature(pydantic_like) is None
    assert m.compile(SOP(json=pydantic_like)).backend == "xgrammar"
    m.shutdown()
