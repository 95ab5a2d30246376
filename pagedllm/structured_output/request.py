"""One request's grammar state: the (possibly still compiling) grammar and its matcher.

The scheduler (pure Python) sees only this object's methods: ``is_ready``, ``error``,
``accept_tokens``, ``rollback`` and ``is_terminated``; the engine core calls ``fill_bitmask``.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

from pagedllm.structured_output.backend import GrammarMatcher, clean_error


class StructuredOutputRequest:
    """Grammar state of one core request (one per ``n > 1`` child).

    Args:
        grammar: future of the request's ``CompiledGrammar`` (shared through the cache).

    The matcher is created on first use, from the engine thread. Its state always matches the
    request's output tokens: tokens are accepted as the scheduler appends them, and a
    preempted request keeps it (its outputs are kept; only the KV cache is recomputed).
    """

    def __init__(self, grammar: Future) -> None:
        self._grammar = grammar
        self._matcher: Optional[GrammarMatcher] = None
        self.num_accepted = 0

    def is_ready(self) -> bool:
        """The grammar finished compiling (successfully or not): the request may be scheduled."""
        return self._grammar.done()

    def error(self) -> Optional[str]:
        """Why the grammar could not be compiled, or None (also None while compiling)."""
        if not self._grammar.done():
            return None
        exc = self._grammar.exception()
        return None if exc is None else clean_error(exc)

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            self._matcher = self._grammar.result().new_matcher()
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher over newly sampled tokens; False when one is not allowed."""
        ok = self.matcher.accept_tokens(token_ids)
        if ok:
            self.num_accepted += len(token_ids)
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (the speculative-decoding hook:
        draft tokens accepted for their bitmask, then rejected by verification)."""
        num_tokens = min(num_tokens, self.num_accepted)
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Allowed next tokens into ``bitmask[row]`` (int32 ``[rows, ceil(V/32)]``, CPU)."""
        self.matcher.fill_bitmask(bitmask, row)
