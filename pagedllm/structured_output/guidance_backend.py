"""llguidance backend ("guidance", vLLM's name): JSON schema (with ``whitespace_pattern``),
regex (incl. Unicode classes xgrammar lacks), choice, Lark and GBNF grammars; an Earley parser
over a lexer (https://github.com/guidance-ai/llguidance)."""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.structured_output.backend import (CompiledGrammar, GrammarMatcher, GrammarSpec,
                                                StructuredOutputBackend, clean_error)


class GuidanceMatcher(GrammarMatcher):
    """llguidance's matcher under this module's contract. llguidance reports "stopped" as soon as
    the grammar cannot continue, i.e. after its last real token; xgrammar's ``is_terminated``
    (and this contract) means "a stop token was accepted". So the grammar is terminated here only
    once EOS has been taken in the stopped state (the bitmask allows only EOS there): the engine
    then finishes the request on that EOS, which the output text leaves out as with xgrammar.
    Finishing on "stopped" instead ended the request on its last real token, and the output
    processor, which drops a stop finish's final token (the EOS), cut that token from the text.
    llguidance keeps no rollback entry for an EOS taken while stopped, so :meth:`rollback` counts it."""

    def __init__(self, matcher: Any, eos_token_id: Optional[int]) -> None:
        self._m = matcher
        self._eos = eos_token_id
        self._eos_taken = False  # EOS accepted in the stopped state (the grammar's end)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        m = self._m
        for t in token_ids:
            t = int(t)
            if m.is_stopped():
                # NOTE: a grammar that cannot continue allows only EOS; try_consume_tokens()
                # refuses it there, consume_token() takes it.
                if self._eos_taken or t != self._eos or not m.consume_token(t):
                    return False
                self._eos_taken = True
            # NOTE: consume_token() on a refused token leaves a permanent error state;
            # try_consume_tokens() stops before it (our contract: the valid prefix is consumed).
            elif m.try_consume_tokens([t]) != 1:
                return False
        return not m.is_error()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._eos_taken:
            self._eos_taken = False  # (no llguidance rollback entry for it)
            num_tokens -= 1
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask
        fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        if self._eos is None:  # (no EOS to wait for: the grammar's end is the end)
            return bool(self._m.is_stopped())
        return self._eos_taken

    def reset(self) -> None:
        self._m.reset()
        self._eos_taken = False

    def find_jump_forward_string(self) -> str:
        if self._m.is_stopped() or self._m.is_error():
            return ""
        ff = bytes(self._m.compute_ff_bytes())
        # NOTE: forced bytes may end inside a UTF-8 character: keep the whole characters.
        return ff.decode("utf-8", errors="ignore") if ff else ""


class GuidanceCompiled(CompiledGrammar):
    backend = "guidance"

    def __init__(self, prototype: Any, eos_token_id: Optional[int]) -> None:
        # NOTE: building an LLMatcher parses the grammar (up to ~1 s for huge ones); copies are cheap.
        self._proto = prototype
        self._eos = eos_token_id

    def new_matcher(self) -> GrammarMatcher:
        return GuidanceMatcher(self._proto.deep_copy(), self._eos)


def _no_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``"additionalProperties": false`` (``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GuidanceBackend(StructuredOutputBackend):
    """Raises (constructor): ValueError when llguidance cannot wrap the tokenizer."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_id)
        import llguidance.hf
        try:
            self._tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                     eos_token=eos_token_id)
        except Exception as e:
            raise ValueError(f"llguidance cannot use this tokenizer: {clean_error(e)}") from None

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar for ``spec``. Raises ValueError for what llguidance lacks."""
        import llguidance
        from llguidance import LLMatcher

        if spec.kind in ("json", "json_object"):
            schema = json.loads(spec.spec) if spec.kind == "json" else {"type": "object"}
            if not spec.additional_properties:
                schema = _no_additional_properties(schema)
            opts: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
            if spec.whitespace_pattern is not None:
                opts["whitespace_pattern"] = spec.whitespace_pattern
            elif spec.max_whitespace_cnt is not None:
                # whitespace_flexible is r"[\x20\x0A\x0D\x09]+" between tokens; bounded here
                opts["whitespace_pattern"] = r"[\x20\x0A\x0D\x09]{1,%d}" % spec.max_whitespace_cnt
            return LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        if spec.whitespace_pattern is not None:
            raise ValueError(f"{spec.field}: whitespace_pattern applies to JSON constraints only")
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            return llguidance.grammar_from("choice", json.loads(spec.spec))
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", spec.spec)
        raise ValueError(f"{spec.field}: not supported by the guidance backend")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        try:
            grammar = self.grammar_text(spec)
        except ValueError as e:
            msg = clean_error(e)
            raise ValueError(msg if msg.startswith(spec.field) else
                             f"{spec.field}: guidance cannot compile it: {msg}") from None
        err = LLMatcher.validate_grammar(grammar, self._tok)
        if err:
            raise ValueError(f"{spec.field}: guidance cannot compile it: {err.strip()}")
        m = LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{spec.field}: guidance cannot compile it: {m.get_error().strip()}")
        return GuidanceCompiled(m, self.eos_token_id)
