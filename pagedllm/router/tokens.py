"""The router's prompt tokenization with a cache of text segments (pure Python over the model's
HF ``tokenizers`` backend; no torch).

Why: prefix routing tokenizes every chat prompt (``render_chat`` then ``encode``), and most of a
chat prompt repeats from request to request (the system prompt, every earlier turn). A
``tokenizers`` encode first cuts the text at its added tokens (``<|im_start|>``, ...), then
normalizes, pre-tokenizes and encodes each piece between them on its own, so the ids of a text
are the ids of its pieces, concatenated, with each added token's id between them. This module
cuts the text the same way and keeps the ids of recent pieces.

When it applies: a tokenizer with a Rust ``tokenizers`` backend whose added tokens neither strip
the whitespace around them nor are normalized or single-word (their matching would then depend
on the neighbours). Otherwise, and for the first ``verify`` encodes anyway (each is compared with
a full ``encode``; one mismatch turns the cache off for good), the full encode is used.

Bound: at most ``max_entries`` pieces and ``max_chars`` characters of pieces (the least recently
used go first); ``stats()`` counts entries, hits, misses and evictions for ``/metrics``.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any, Optional


class SegmentTokenizer:
    """``encode(text, add_special_tokens)`` equal to ``tokenizer.encode``, with the pieces between
    added tokens cached (module docstring).

    Args:
        tokenizer: an HF tokenizer (``encode``; ``_tokenizer`` for the fast path).
        max_entries: most cached pieces (>= 1).
        max_chars: most characters over all cached pieces (>= 1).
        verify: how many encodes to check against the full ``encode`` first.

    Raises:
        ValueError: a bound < 1.
    """

    def __init__(self, tokenizer: Any, max_entries: int = 8192, max_chars: int = 8 << 20,
                 verify: int = 32) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError(f"SegmentTokenizer: bounds must be >= 1, got {max_entries}, {max_chars}")
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._verify_left = verify
        self._lock = threading.Lock()
        self._cache: "OrderedDict[str, list[int]]" = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0
        self.evicted = 0
        self.disabled_reason: Optional[str] = None
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._split: Optional[re.Pattern] = None
        self._special: dict[str, int] = {}
        try:
            added = self._backend.get_added_tokens_decoder()  # type: ignore[union-attr]
        except Exception:
            self.disabled_reason = "no tokenizers backend"
            return
        for tid, t in added.items():
            if t.lstrip or t.rstrip or t.single_word or (t.normalized and self._backend.normalizer is not None):
                self.disabled_reason = f"added token {t.content!r} strips or is normalized"
                return
            self._special[t.content] = tid
        if self._special:
            alts = sorted(self._special, key=len, reverse=True)  # the longest match first
            self._split = re.compile("(" + "|".join(re.escape(s) for s in alts) + ")")

    @property
    def enabled(self) -> bool:
        """Whether pieces are cached (else every encode is a full one)."""
        return self.disabled_reason is None

    def _full(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            self.hits += 1
            return ids
        self.misses += 1
        ids = self._backend.encode(piece, add_special_tokens=False).ids  # type: ignore[union-attr]
        if len(piece) <= self.max_chars:
            self._cache[piece] = ids
            self._chars += len(piece)
            while len(self._cache) > self.max_entries or self._chars > self.max_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
                self.evicted += 1
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``text`` (as ``tokenizer.encode(text, add_special_tokens=...)``)."""
        if not self.enabled or add_special_tokens:
            # NOTE: special tokens a template adds (BOS, ...) are the tokenizer's post-processor's
            # business: full encode.
            return self._full(text, add_special_tokens)
        with self._lock:
            out: list[int] = []
            parts = self._split.split(text) if self._split is not None else [text]
            for i, p in enumerate(parts):
                if i % 2:
                    out.append(self._special[p])
                elif p:
                    out.extend(self._piece(p))
            if self._verify_left > 0:
                self._verify_left -= 1
                full = self._full(text, False)
                if full != out:
                    self.disabled_reason = "a cached encode differed from the full encode"
                    self._cache.clear()
                    self._chars = 0
                    return full
            return out

    def stats(self) -> dict[str, int]:
        """Counters for /metrics."""
        return {"entries": len(self._cache), "capacity": self.max_entries, "chars": self._chars,
                "hits": self.hits, "misses": self.misses, "evicted": self.evicted}


__all__ = ["SegmentTokenizer"]
