"""The grammar-backend interface: a backend compiles a :class:`GrammarSpec` into a shared
:class:`CompiledGrammar`; each request gets its own :class:`GrammarMatcher` from it.

Token bitmasks (both backends' format, vLLM's too): int32 ``[rows, ceil(vocab_size / 32)]``;
bit ``j`` of word ``w`` of a row set = token ``32 * w + j`` allowed next.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT, StructuredOutputsParams

# Constraint kinds whose grammar contains JSON (the whitespace options apply to them).
JSON_KINDS = ("json", "json_object", "structural_tag")

# Grammar libraries prefix C++ errors with "[hh:mm:ss] /path/file.cc:123: "; clients need only the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def clean_error(e: BaseException) -> str:
    """An exception's message without a C++ source-location prefix, on one line where possible."""
    msg = str(e).strip() or type(e).__name__
    return _CPP_PREFIX.sub("", msg).strip()


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint in canonical form: the compile cache key (with the backend).

    Attributes:
        kind: "json", "json_object", "regex", "choice", "grammar" or "structural_tag".
        spec: canonical text: JSON (compact; key order kept: it is the order properties are generated in) for json / structural_tag / choice,
            the pattern for regex, the grammar text for grammar, "" for json_object.
        any_whitespace: JSON may have whitespace between tokens (False: compact JSON, none at all).
        max_whitespace_cnt: with ``any_whitespace``, the most whitespace characters in one run
            between two JSON tokens (None: unbounded); None for kinds without JSON and for
            compact JSON (canonical, so equal grammars share a cache entry).
        additional_properties: objects may carry properties their schema does not name (only
            where the schema itself allows them).
        whitespace_pattern: regex JSON whitespace must match, or None.
    """

    kind: str
    spec: str
    any_whitespace: bool = True
    additional_properties: bool = True
    whitespace_pattern: Optional[str] = None
    max_whitespace_cnt: Optional[int] = DEFAULT_MAX_WHITESPACE_CNT

    def __post_init__(self) -> None:
        if self.kind not in JSON_KINDS or not self.any_whitespace:
            object.__setattr__(self, "max_whitespace_cnt", None)

    @property
    def field(self) -> str:
        """The request field to name in an error ("structured_outputs.json", ...)."""
        return f"structured_outputs.{self.kind}"

    @classmethod
    def from_params(cls, p: StructuredOutputsParams, disable_any_whitespace: bool = False,
                    disable_additional_properties: bool = False,
                    max_whitespace_cnt: Optional[int] = DEFAULT_MAX_WHITESPACE_CNT) -> "GrammarSpec":
        """Canonical spec of ``p``; the two flags are engine-wide defaults OR-ed with ``p``'s;
        ``max_whitespace_cnt`` is the engine's bound on JSON whitespace runs (None: unbounded)."""
        kind = p.kind
        if kind in ("json", "structural_tag"):
            spec = json.dumps(getattr(p, kind), separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            spec = json.dumps(p.choice, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(p, kind)
        return cls(kind=kind, spec=spec,
                   any_whitespace=not (p.disable_any_whitespace or disable_any_whitespace),
                   additional_properties=not (p.disable_additional_properties or disable_additional_properties),
                   whitespace_pattern=p.whitespace_pattern, max_whitespace_cnt=max_whitespace_cnt)


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: used from the engine thread."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids`` (in order); False (state unchanged past the first rejected
        token) when one is not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding: rejected drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 torch tensor, CPU, see the
        module docstring). Stop tokens are allowed only where the grammar may end."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has ended (a stop token accepted, or nothing more can follow)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""

    def find_jump_forward_string(self) -> str:
        """The longest text the grammar forces from here (every valid continuation starts with
        it; "" when the next character is a choice). Does not advance the matcher."""
        return ""


class CompiledGrammar(ABC):
    """A compiled constraint, shared by every request with the same spec (immutable)."""

    backend: str = ""

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (cheap)."""


class StructuredOutputBackend(ABC):
    """A grammar library bound to one tokenizer and vocabulary.

    Args:
        tokenizer: the engine's Hugging Face (fast) tokenizer.
        vocab_size: the model's vocabulary size (logits width; may exceed the tokenizer's:
            the extra ids are never allowed).
        eos_token_id: the token that ends generation (allowed where the grammar may end).
    """

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_id = eos_token_id

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` (thread-safe; called from the compile threads).

        Raises:
            ValueError: the backend cannot compile it (unsupported feature, invalid schema,
                regex or grammar); the message says why and names ``spec.field``.
        """
