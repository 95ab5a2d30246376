"""xgrammar backend (the default): JSON schema, regex, choice, EBNF/GBNF and Lark grammars,
structural tags; a pushdown automaton with precomputed token masks (https://github.com/mlc-ai/xgrammar)."""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.structured_output.backend import (CompiledGrammar, GrammarMatcher, GrammarSpec,
                                                StructuredOutputBackend, clean_error)


def _whitespace_options(spec: GrammarSpec) -> dict[str, Any]:
    """``compile_json_schema`` keywords for ``spec``'s JSON whitespace: at most
    ``max_whitespace_cnt`` characters in a run, or compact JSON (``{"a":1}``) without
    ``any_whitespace``."""
    if spec.any_whitespace:
        return {"any_whitespace": True, "max_whitespace_cnt": spec.max_whitespace_cnt}
    # NOTE: any_whitespace=False alone is json.dumps' fixed layout with ", " and ": " (a space is
    # then required after every comma and colon); compact JSON needs the separators too.
    return {"any_whitespace": False, "separators": (",", ":")}


def bound_tag_whitespace(tag: Any, max_whitespace_cnt: int) -> Any:
    """A copy of the structural tag ``tag`` (JSON value) whose ``json_schema`` formats without
    their own ``max_whitespace_cnt`` get this one (the JSON schemas themselves are kept as is)."""
    if isinstance(tag, list):
        return [bound_tag_whitespace(t, max_whitespace_cnt) for t in tag]
    if not isinstance(tag, dict):
        return tag
    out = {k: v if k == "json_schema" else bound_tag_whitespace(v, max_whitespace_cnt)
           for k, v in tag.items()}
    if out.get("type") == "json_schema" and out.get("max_whitespace_cnt") is None:
        out["max_whitespace_cnt"] = max_whitespace_cnt
    return out


# String formats xgrammar enforces (its JSON schema converter); any other string format it ignores.
_XGRAMMAR_STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords xgrammar accepts in a schema but does not enforce (measured on xgrammar 0.2.8 by
# checking that the grammar accepts an instance that violates them; vLLM's
# ``has_xgrammar_unsupported_json_features`` lists the first ones).
_XGRAMMAR_UNENFORCED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "not",
                        "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "unevaluatedProperties", "unevaluatedItems")
# Keys beside "$ref" that constrain nothing (anything else there xgrammar ignores).
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title",
                          "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})


def unenforced_json_feature(schema: Any) -> Optional[str]:
    """The first constraint in ``schema`` (a JSON schema, parsed) that xgrammar would compile
    but not enforce, as "keyword at path"; None when xgrammar enforces all of it. Checked:
    ``_XGRAMMAR_UNENFORCED``, ``allOf`` of more than one schema, a string ``pattern`` or
    ``format`` together with ``minLength`` / ``maxLength`` (xgrammar keeps only the first), a
    string ``format`` outside ``_XGRAMMAR_STRING_FORMATS``, constraints beside a ``$ref``."""
    def walk(node: Any, path: str) -> Optional[str]:
        if isinstance(node, list):
            for i, v in enumerate(node):
                found = walk(v, f"{path}[{i}]")
                if found:
                    return found
            return None
        if not isinstance(node, dict):
            return None
        at = path or "the root"
        for k in _XGRAMMAR_UNENFORCED:
            if k in node:
                return f"'{k}' at {at}"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of {len(node['allOf'])} schemas at {at}"
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types or ())
        if "string" in types or not types:
            if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
                return f"'{'pattern' if 'pattern' in node else 'format'}' with a length bound at {at}"
            if "string" in types and "format" in node and node["format"] not in _XGRAMMAR_STRING_FORMATS:
                return f"format {node['format']!r} at {at}"
        if "$ref" in node:
            extra = sorted(k for k in node if k not in _ANNOTATIONS)
            if extra:
                return f"'{extra[0]}' beside '$ref' at {at}"
        for k in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(node.get(k), dict):
                for name, sub in node[k].items():
                    found = walk(sub, f"{path}.{k}.{name}" if path else f"{k}.{name}")
                    if found:
                        return found
        for k in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "propertyNames"):
            if k in node:
                found = walk(node[k], f"{path}.{k}" if path else k)
                if found:
                    return found
        return None

    return walk(schema, "")


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for t in token_ids:
            if not self._m.accept_token(int(t)):
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def reset(self) -> None:
        self._m.reset()

    def find_jump_forward_string(self) -> str:
        return self._m.find_jump_forward_string()


class XgrammarCompiled(CompiledGrammar):
    backend = "xgrammar"

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def new_matcher(self) -> GrammarMatcher:
        import xgrammar as xgr
        return XgrammarMatcher(xgr.GrammarMatcher(self._compiled))


class XgrammarBackend(StructuredOutputBackend):
    """Compiles with one ``xgrammar.GrammarCompiler`` (its own cache off: ours is the bounded one).

    Raises (constructor): ValueError when the tokenizer cannot be described to xgrammar.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_id)
        import xgrammar as xgr

        stop = [eos_token_id] if eos_token_id is not None else None
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=stop)
        except Exception as e:
            raise ValueError(f"xgrammar cannot use this tokenizer: {clean_error(e)}") from None
        # NOTE: one compiler thread per grammar; parallelism comes from our compile pool, whose
        # threads share this compiler (as vLLM's do: compile_* may be called concurrently).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            return XgrammarCompiled(self._compile(spec))
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / its own errors for bad input
            raise ValueError(f"{spec.field}: xgrammar cannot compile it: {clean_error(e)}") from None

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.whitespace_pattern is not None:
            raise ValueError(f"{spec.field}: whitespace_pattern is not supported by xgrammar "
                             "(use the guidance backend)")
        if spec.kind == "json":
            unenforced = unenforced_json_feature(json.loads(spec.spec))
            if unenforced:
                # NOTE: a grammar that ignored it would let outputs break the schema; "auto" then
                # takes the guidance backend, which enforces most of these (manager._compile_auto).
                raise ValueError(f"{spec.field}: the schema uses {unenforced}, which the xgrammar "
                                 "backend does not enforce (the guidance backend enforces multipleOf, "
                                 "allOf and length bounds beside a pattern or format)")
            # NOTE: strict_mode (xgrammar's and vLLM's default) already gives objects only the
            # properties their schema names unless it allows more, so disable_additional_properties
            # needs nothing extra here.
            return c.compile_json_schema(spec.spec, strict_mode=True, **_whitespace_options(spec))
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', **_whitespace_options(spec))
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            # EBNF string literals take JSON's escapes (\" \\ \n \uXXXX).
            choices = json.loads(spec.spec)
            return c.compile_grammar("root ::= " + " | ".join(
                json.dumps(s, ensure_ascii=False) for s in choices))
        if spec.kind == "grammar":
            if "::=" in spec.spec:
                return c.compile_grammar(spec.spec)
            return c.compile_lark(spec.spec)
        if spec.kind == "structural_tag":
            tag = json.loads(spec.spec)
            if isinstance(tag, dict) and "structures" in tag:
                # vLLM's first format: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
                import xgrammar as xgr
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})),
                                               end=s["end"]) for s in tag["structures"]]
                tag = xgr.StructuralTag.from_legacy_structural_tag(
                    items, list(tag.get("triggers", []))).model_dump(mode="json")
            if spec.max_whitespace_cnt is not None:
                tag = bound_tag_whitespace(tag, spec.max_whitespace_cnt)
            return c.compile_structural_tag(json.dumps(tag, ensure_ascii=False))
        raise ValueError(f"{spec.field}: unknown constraint kind {spec.kind!r}")
