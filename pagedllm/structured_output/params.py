"""What a request asks to be constrained to (vLLM's ``StructuredOutputsParams``).

Pure Python (no torch, no grammar library): the offline API builds it, the server maps
``response_format`` / ``structured_outputs`` / ``guided_*`` onto it, and
:class:`~pagedllm.structured_output.manager.StructuredOutputManager` turns it into a grammar.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

# The constraint fields, in vLLM's order; exactly one must be set.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Grammar backends a request or the engine may name (vLLM's names).
BACKEND_NAMES = ("auto", "xgrammar", "guidance")
# Most whitespace characters JSON may have in one run between two tokens (after "{", ",", ":",
# ...), unless the engine's ``max_whitespace_cnt`` says otherwise. Without a bound a model that
# favours newlines can emit "{" and then whitespace until max_tokens (vLLM #38696): every step
# allows another newline. 16 still fits pretty-printed JSON (json.dumps indent=2 seven levels
# deep, indent=4 three levels) and "\n\n" blank lines.
DEFAULT_MAX_WHITESPACE_CNT = 16


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's field names and semantics).

    Exactly one of the constraint fields is set:

    Attributes:
        json: a JSON schema (dict, or its JSON text): the output is one JSON value that
            validates against it.
        regex: the output matches this regular expression in full.
        choice: the output is exactly one of these strings (non-empty list).
        grammar: a context-free grammar: GBNF/EBNF (``root ::= ...``, the xgrammar and
            llama.cpp dialect) or Lark (``start: ...``, llguidance).
        json_object: True: the output is any JSON object (OpenAI's ``json_object`` mode).
        structural_tag: xgrammar's structural tag (JSON text or dict): free text with
            schema-constrained segments between begin/end tags.

    Options:
        disable_any_whitespace: compact JSON: no whitespace between tokens at all (``{"a":1}``).
            Without it JSON may have whitespace between tokens, at most the engine's
            ``max_whitespace_cnt`` characters (default 16) in a row.
        disable_additional_properties: objects allow only the properties their schema names.
        whitespace_pattern: the regex JSON whitespace must match (guidance backend only).

    Raises:
        ValueError: naming the field, when no or several constraints are set or a value
            has the wrong type (an empty ``choice`` list, a ``json`` string that is not JSON,
            an empty regex or grammar).
    """

    json: Optional[str | dict] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str | dict] = None

    # Set by the engine when it validates the request (not constructor arguments).
    _backend: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    _backend_was_auto: bool = field(default=False, init=False, repr=False, compare=False)
    # The request field the constraint came from ("response_format", "guided_json", ...; set
    # by the server), for error messages.
    _source: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None  # json_object=False asks for nothing (as leaving it out)
        set_kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(set_kinds) > 1:
            raise ValueError(
                f"structured_outputs: only one kind of constraint may be set, got {set_kinds}.")
        if not set_kinds:
            raise ValueError(
                f"structured_outputs: one constraint must be set (one of {list(CONSTRAINT_KINDS)}).")
        if self.json is not None:
            self.json = _json_value(self.json, "json", want=dict)
        if self.structural_tag is not None:
            self.structural_tag = _json_value(self.structural_tag, "structural_tag", want=dict)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex: must be a non-empty string.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar: must be a non-empty string.")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object: must be true.")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise ValueError("structured_outputs.choice: must be a list of strings.")
            self.choice = list(self.choice)
            if not self.choice:
                raise ValueError("structured_outputs.choice: the list of choices is empty.")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice: every choice must be a string.")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern: must be a string.")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name}: must be a boolean.")

    @property
    def kind(self) -> str:
        """The constraint field that is set ("json", "regex", ...)."""
        for k in CONSTRAINT_KINDS:
            if getattr(self, k) is not None:
                return k
        raise AssertionError("no constraint set")  # __post_init__ guarantees one

    def rename_error(self, e: BaseException) -> ValueError:
        """``e`` as a ValueError whose leading ``structured_outputs.<kind>`` names the request
        field the constraint came from (``_source``), when the server set one."""
        msg = str(e)
        canonical = f"structured_outputs.{self.kind}"
        if self._source and msg.startswith(canonical):
            msg = self._source + msg[len(canonical):]
        return ValueError(msg)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StructuredOutputsParams":
        """Build from a JSON object (the server's ``structured_outputs`` field).

        Raises:
            ValueError: an unknown key or a bad value, naming the field.
        """
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError("structured_outputs: must be an object.")
        allowed = set(CONSTRAINT_KINDS) | {"disable_any_whitespace", "disable_additional_properties",
                                           "whitespace_pattern", "disable_fallback"}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}.")
        return cls(**{k: v for k, v in d.items() if k != "disable_fallback"})


def _json_value(value: Any, name: str, want: type) -> Any:
    """``value`` as a parsed JSON object (a dict stays a dict; a string is parsed)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.{name}: not valid JSON: {e}") from None
    elif hasattr(value, "model_json_schema"):  # a pydantic model class
        value = value.model_json_schema()
    if not isinstance(value, want):
        raise ValueError(f"structured_outputs.{name}: must be a JSON object, got {type(value).__name__}.")
    return value
