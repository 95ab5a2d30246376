"""Whitespace in JSON grammars is bounded (issue 37; vLLM #38696): a model that favours
newlines cannot emit "{" and then whitespace until max_tokens. Both backends on SmolLM2's real
tokenizer: the bitmask refuses a run longer than ``max_whitespace_cnt`` (default 16) and no
allowed token starts with more whitespace than is left; pretty-printed JSON still passes;
``disable_any_whitespace`` is compact JSON; forced tool calls (the tool-call grammar path) get
the same bound, so their ``arguments`` parse, whole and streamed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from so_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB, allowed_ids
from pagedllm.structured_output.backend import GrammarSpec
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT
from pagedllm.structured_output.params import StructuredOutputsParams as SOP

BACKENDS = ["xgrammar", "guidance"]
WS = " \n\r\t"
NO_PARAMS = {"type": "object", "properties": {}}
NESTED = {"type": "object",
          "properties": {"user": {"type": "object",
                                  "properties": {"name": {"type": "string"},
                                                 "langs": {"type": "array",
                                                           "items": {"type": "string"}}},
                                  "required": ["name", "langs"]},
                         "ok": {"type": "boolean"}},
          "required": ["user", "ok"]}
NESTED_DOC = {"user": {"name": "Ada", "langs": ["en", "fr"]}, "ok": True}


@pytest.fixture(scope="module")
def backends(smollm2_tokenizer):
    from pagedllm.structured_output.guidance_backend import GuidanceBackend
    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
    return {"xgrammar": XgrammarBackend(smollm2_tokenizer, SMOLLM2_VOCAB, SMOLLM2_EOS),
            "guidance": GuidanceBackend(smollm2_tokenizer, SMOLLM2_VOCAB, SMOLLM2_EOS)}


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def leading_ws(tok, token_id):
    """How many whitespace characters token ``token_id`` starts with (its whole length for a
    whitespace-only token)."""
    text = tok.decode([token_id])
    return len(text) - len(text.lstrip(WS))


def newline_loving_walk(matcher, tok, target, cap=200):
    """A model that wants to write ``target`` but prefers a newline wherever the grammar allows
    one (at most ``cap`` in a row, so an unbounded grammar shows as a run of ``cap``): writes
    ``target`` one character per token, each character preceded by as many newlines as the
    matcher takes. Returns (text, longest newline run, ended with EOS)."""
    nl = enc(tok, "\n")
    assert len(nl) == 1
    text, longest = "", 0
    for ch in target:
        run = 0
        while run < cap and nl[0] in allowed_ids(matcher, SMOLLM2_VOCAB):
            assert matcher.accept_tokens(nl)
            run += 1
        longest = max(longest, run)
        text += "\n" * run
        if run == cap:
            return text, longest, False
        ids = enc(tok, ch)
        assert len(ids) == 1, ch
        assert matcher.accept_tokens(ids), (text, ch)
        text += ch
    ended = SMOLLM2_EOS in allowed_ids(matcher, SMOLLM2_VOCAB) and matcher.accept_tokens([SMOLLM2_EOS])
    return text, longest, ended


# ----------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind,spec_text", [("json", json.dumps(NO_PARAMS)), ("json", json.dumps(NESTED)),
                                            ("json_object", "")])
def test_bitmask_refuses_a_whitespace_run_past_the_bound(backends, smollm2_tokenizer, name, kind,
                                                        spec_text):
    tok = smollm2_tokenizer
    n = DEFAULT_MAX_WHITESPACE_CNT
    spec = GrammarSpec(kind, spec_text)
    assert spec.max_whitespace_cnt == n  # bounded by default, even built by hand
    m = backends[name].compile(spec).new_matcher()
    nl = enc(tok, "\n")[0]
    assert m.accept_tokens(enc(tok, "{"))
    for used in range(n + 1):
        allowed = allowed_ids(m, SMOLLM2_VOCAB)
        # no allowed token starts with more whitespace than the run has left
        assert max(leading_ws(tok, t) for t in allowed) <= n - used, (name, used)
        if used < n:
            assert nl in allowed
            assert m.accept_tokens([nl])
    assert nl not in allowed and not m.accept_tokens([nl])  # the run is full
    assert SMOLLM2_EOS not in allowed  # and the object is not closed yet
    closing = '"user"' if spec_text == json.dumps(NESTED) else "}"
    assert m.accept_tokens(enc(tok, closing))  # what may follow the whitespace still may


@pytest.mark.parametrize("name", BACKENDS)
def test_unbounded_only_when_asked(backends, smollm2_tokenizer, name):
    tok = smollm2_tokenizer
    m = backends[name].compile(GrammarSpec("json", json.dumps(NO_PARAMS), max_whitespace_cnt=None)).new_matcher()
    assert m.accept_tokens(enc(tok, "{") + enc(tok, "\n") * 100)
    m = backends[name].compile(GrammarSpec("json", json.dumps(NO_PARAMS), max_whitespace_cnt=3)).new_matcher()
    assert m.accept_tokens(enc(tok, "{") + enc(tok, "\n") * 3)
    assert not m.accept_tokens(enc(tok, "\n"))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layout", [{"indent": 2}, {"indent": 4}, {"indent": "\t"}, {},
                                    {"separators": (",", ":")}])
def test_pretty_printed_json_still_passes(backends, smollm2_tokenizer, name, layout):
    tok = smollm2_tokenizer
    doc = json.dumps(NESTED_DOC, **layout)
    m = backends[name].compile(GrammarSpec("json", json.dumps(NESTED))).new_matcher()
    assert m.accept_tokens(enc(tok, doc)), doc
    assert SMOLLM2_EOS in allowed_ids(m, SMOLLM2_VOCAB)
    spaced = '{\n\n  "user" :  {"name": "Ada",\n    "langs": [ "en" , "fr" ] } ,\n  "ok": true\n}'
    m = backends[name].compile(GrammarSpec("json", json.dumps(NESTED))).new_matcher()
    assert m.accept_tokens(enc(tok, spaced)) and m.accept_tokens([SMOLLM2_EOS])


@pytest.mark.parametrize("name", BACKENDS)
def test_newline_loving_model_ends_with_valid_json(backends, smollm2_tokenizer, name):
    tok = smollm2_tokenizer
    target = json.dumps(NESTED_DOC, separators=(",", ":"))
    bounded = backends[name].compile(GrammarSpec("json", json.dumps(NESTED))).new_matcher()
    text, longest, ended = newline_loving_walk(bounded, tok, target)
    assert ended and longest == DEFAULT_MAX_WHITESPACE_CNT
    assert json.loads(text) == NESTED_DOC
    # the same model without the bound never gets past the first "{" (vLLM #38696)
    free = backends[name].compile(GrammarSpec("json", json.dumps(NESTED), max_whitespace_cnt=None))
    text, longest, ended = newline_loving_walk(free.new_matcher(), tok, target)
    assert not ended and text == "{" + "\n" * 200


def test_structural_tag_json_is_bounded_too(backends, smollm2_tokenizer):
    tok = smollm2_tokenizer
    tag = {"type": "structural_tag", "structures": [{"begin": "<fn>", "schema": NO_PARAMS, "end": "</fn>"}],
           "triggers": ["<fn>"]}
    for max_ws, accepted in ((None, 40), (DEFAULT_MAX_WHITESPACE_CNT, DEFAULT_MAX_WHITESPACE_CNT)):
        spec = GrammarSpec("structural_tag", json.dumps(tag), max_whitespace_cnt=max_ws)
        m = backends["xgrammar"].compile(spec).new_matcher()
        assert m.accept_tokens(enc(tok, "Now <fn>{"))
        n = 0
        while n < 40 and m.accept_tokens(enc(tok, "\n")):
            n += 1
        assert n == accepted
        assert m.accept_tokens(enc(tok, "}</fn> done"))
    # a format's own max_whitespace_cnt is kept
    from pagedllm.structured_output.xgrammar_backend import bound_tag_whitespace
    own = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": 2}}}
    assert bound_tag_whitespace(own, 16) == own
    del own["format"]["content"]["max_whitespace_cnt"]
    assert bound_tag_whitespace(own, 16)["format"]["content"]["max_whitespace_cnt"] == 16
    assert "max_whitespace_cnt" not in own["format"]["content"]  # a copy: the request's tag is kept


# ----------------------------------------------------------------------------- the manager
def test_engine_config_sets_the_bound(smollm2_tokenizer):
    assert StructuredOutputsConfig().max_whitespace_cnt == DEFAULT_MAX_WHITESPACE_CNT
    for cfg, expect in (({}, DEFAULT_MAX_WHITESPACE_CNT), ({"max_whitespace_cnt": 4}, 4),
                        ({"max_whitespace_cnt": None}, None)):
        m = StructuredOutputManager(smollm2_tokenizer, SMOLLM2_VOCAB, SMOLLM2_EOS, cfg)
        _, spec = m.spec_for(SOP(json=NO_PARAMS))
        assert spec.max_whitespace_cnt == expect
        # options that make the bound moot leave it out of the cache key
        assert m.spec_for(SOP(json=NO_PARAMS, disable_any_whitespace=True))[1].max_whitespace_cnt is None
        assert m.spec_for(SOP(regex="a+"))[1].max_whitespace_cnt is None
        mm = m.compile(SOP(json=NO_PARAMS)).new_matcher()
        taken = 0
        while taken < 30 and mm.accept_tokens(enc(smollm2_tokenizer, "{" if taken == 0 else "\n")):
            taken += 1
        assert taken - 1 == (expect if expect is not None else 29)
        m.shutdown()


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_bad_bound_is_a_value_error_naming_the_key(value):
    with pytest.raises(ValueError, match=r"structured_outputs_config\.max_whitespace_cnt"):
        StructuredOutputsConfig.from_any({"max_whitespace_cnt": value})


# ----------------------------------------------------------------------------- compact JSON
@pytest.mark.parametrize("name", BACKENDS)
def test_disable_any_whitespace_is_compact_json(backends, smollm2_tokenizer, name):
    tok = smollm2_tokenizer
    spec = GrammarSpec("json", json.dumps(NESTED), any_whitespace=False)
    compact = json.dumps(NESTED_DOC, separators=(",", ":"))
    m = backends[name].compile(spec).new_matcher()
    assert m.accept_tokens(enc(tok, compact)) and m.accept_tokens([SMOLLM2_EOS])
    for spaced in (json.dumps(NESTED_DOC), json.dumps(NESTED_DOC, indent=2)):
        assert not backends[name].compile(spec).new_matcher().accept_tokens(enc(tok, spaced))
    m = backends[name].compile(spec).new_matcher()
    assert m.accept_tokens(enc(tok, '{"user":'))
    assert all(leading_ws(tok, t) == 0 for t in allowed_ids(m, SMOLLM2_VOCAB))


# ----------------------------------------------------------------------------- tool calls
def _tool_call_grammar(manager, choice_mode):
    """The grammar the chat route compiles for a forced call of a tool without parameters."""
    from pagedllm.entrypoints.openai.tool_calling import (ToolChoice, constrain_to_json,
                                                          forced_tool_schema, validate_tools)
    tools = validate_tools([{"type": "function", "function": {"name": "get_time"}}])
    choice = ToolChoice(choice_mode, "get_time" if choice_mode == "named" else None)
    sp = SimpleNamespace(structured_outputs=None)
    constrain_to_json(sp, forced_tool_schema(choice, tools, parallel=True), "tool_choice")
    return tools, choice, manager.compile(sp.structured_outputs)


@pytest.mark.parametrize("choice_mode,target", [
    ("named", "{}"), ("required", '[{"name":"get_time","parameters":{}}]')])
def test_forced_tool_call_of_a_tool_without_parameters_ends(smollm2_tokenizer, choice_mode, target):
    from pagedllm.entrypoints.openai.output_parser import OutputParser
    tok = smollm2_tokenizer
    m = StructuredOutputManager(tok, SMOLLM2_VOCAB, SMOLLM2_EOS)
    tools, choice, grammar = _tool_call_grammar(m, choice_mode)
    text, longest, ended = newline_loving_walk(grammar.new_matcher(), tok, target)
    m.shutdown()
    assert ended and 0 < longest <= DEFAULT_MAX_WHITESPACE_CNT
    # what the route makes of that text: one get_time call whose arguments are JSON, whole...
    whole = OutputParser.for_request(tok, choice, tools, None, None).parse(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [
        ("get_time", {})]
    # ... and streamed (one character per step)
    p = OutputParser.for_request(tok, choice, tools, None, None)
    args = ""
    for i, ch in enumerate(text):
        for d in p.feed(ch, final=i == len(text) - 1).tool_calls:
            args += (d.function.arguments or "") if d.function else ""
    assert json.loads(args) == {}
