"""One request's grammar state: the (possibly still compiling) grammar and its matcher.

The scheduler (pure Python) sees only this object's methods: ``is_ready``, ``error``,
``accept_tokens``, ``rollback`` and ``is_terminated``; the engine core calls ``fill_bitmask``.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional

from pagedllm.structured_output.backend import GrammarMatcher, clean_error


class StructuredOutputRequest:
    """Grammar state of one core request (one per ``n > 1`` child).

    Args:
        grammar: future of the request's ``CompiledGrammar`` (shared through the cache).

    The matcher is created on first use, from the engine thread. Its state always matches the
    request's output tokens: tokens are accepted as the scheduler appends them, and a
    preempted request keeps it (its outputs are kept; only the KV cache is recomputed).
    """

    def __init__(self, grammar: Future, reasoner: Any = None,
                 prompt_token_ids: Optional[list[int]] = None,
                 encode: Optional[Callable[[str], list[int]]] = None) -> None:
        self._grammar = grammar
        # Jump-forward: text -> its canonical token ids (the tokenizer, no special tokens).
        self._encode = encode
        self._matcher: Optional[GrammarMatcher] = None
        self.num_accepted = 0
        # With a reasoning parser the grammar applies only after the reasoning: until then
        # every token is allowed and none advances the matcher (vLLM's reasoning_ended).
        self._reasoner = reasoner
        ids = list(prompt_token_ids or [])
        self.reasoning_ended = reasoner is None or reasoner.is_reasoning_end(ids)
        self._ids = ids[-32:]  # the tail: context for an end marker split over tokens

    def is_ready(self) -> bool:
        """The grammar finished compiling (successfully or not): the request may be scheduled."""
        return self._grammar.done()

    def error(self) -> Optional[str]:
        """Why the grammar could not be compiled, or None (also None while compiling)."""
        if not self._grammar.done():
            return None
        if self._grammar.cancelled():
            return "the grammar compile was cancelled (engine shutting down)"
        exc = self._grammar.exception()
        return None if exc is None else clean_error(exc)

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            self._matcher = self._grammar.result().new_matcher()
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher over newly sampled tokens; False when one is not allowed.
        Reasoning tokens are not checked; the tokens after the end of the reasoning are."""
        if not self.reasoning_ended:
            k = self._reasoner.reasoning_end_in(self._ids, token_ids)
            self._ids = (self._ids + list(token_ids))[-32:]  # context for a split marker
            if k is None:
                return True
            self.reasoning_ended = True
            token_ids = list(token_ids[k:])
            if not token_ids:
                return True
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
        return self.reasoning_ended and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int, drafts: Optional[list[int]] = None) -> None:
        """Allowed next tokens into ``bitmask[row]`` (int32 ``[rows, ceil(V/32)]``, CPU); the
        row stays all-allowed while the request is reasoning.

        With ``drafts`` (jump-forward draft tokens, all allowed in sequence: see
        ``jump_forward_tokens``), rows ``row + 1 .. row + len(drafts)`` get the allowed tokens
        after each draft in turn (the matcher is advanced over them and rolled back)."""
        if not self.reasoning_ended:
            return
        m = self.matcher
        m.fill_bitmask(bitmask, row)
        if not drafts:
            return
        n = 0
        for j, t in enumerate(drafts):
            if not m.accept_tokens([t]):
                raise AssertionError(f"jump-forward draft token {t} refused by the grammar")  # checked when drafted
            n += 1
            m.fill_bitmask(bitmask, row + 1 + j)
        m.rollback(n)

    def jump_forward_tokens(self, max_tokens: int) -> list[int]:
        """Jump-forward drafts: the canonical tokens of the text the grammar forces next (at most
        ``max_tokens``; only the leading ones the grammar accepts in sequence), or [] (no forced
        text, the grammar ended or is still reasoning, or no tokenizer). The matcher's state is
        unchanged. The drafts are verified by the model like speculative ones, so a model that
        tokenizes the forced text differently still decodes exactly as step by step."""
        if max_tokens <= 0 or self._encode is None or not self.reasoning_ended:
            return []
        m = self.matcher
        if m.is_terminated():
            return []
        text = m.find_jump_forward_string()
        if not text:
            return []
        ids = self._encode(text)[:max_tokens]
        n = 0
        for t in ids:
            if not m.accept_tokens([t]):
                break
            n += 1
            if m.is_terminated():
                break
        m.rollback(n)
        return list(ids[:n])
