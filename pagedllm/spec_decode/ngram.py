"""N-gram (prompt lookup) proposer: copy what followed the last time the context's tail appeared.

For a request whose tokens so far are ``a[0..L-1]``, find the longest n in
``[prompt_lookup_min, prompt_lookup_max]`` such that the last n tokens ``a[L-n..L-1]`` also end
at an earlier position ``e < L - 1``; among matches of that length the most recent ``e`` with
``k`` tokens after it wins (the freshest context, which also covers the text an output is
copying), else the earliest (in a short cycle the latest occurrence sits right behind the end). The proposal is ``a[e+1 .. e+k]``. (vLLM's ``ngram`` method; Saxena 2023, "Prompt
Lookup Decoding".)

Vectorised: one numpy comparison of every candidate end position per n-gram length (at most
``prompt_lookup_max`` passes over the context), no per-token Python loop. Each live request
keeps an int64 numpy copy of its tokens that only grows (freed by :meth:`remove`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up-to-``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram (``min_n <= n <= max_n``) of ``tokens``.

    Args:
        tokens: int64 ``[L]`` the request's prompt + output.
        min_n / max_n: n-gram length range (>= 1).
        k: most tokens to return.

    Returns:
        int64 ``[m]``, ``0 <= m <= k`` (empty when no n-gram of length >= ``min_n`` recurs).
    """
    L = int(tokens.shape[0])
    if k <= 0 or L < min_n + 1:
        return tokens[:0]
    ends = np.arange(L - 1)  # candidate end positions of an earlier occurrence
    length = np.zeros(L - 1, dtype=np.int64)
    alive = np.ones(L - 1, dtype=bool)
    for t in range(min(max_n, L - 1)):
        idx = ends - t
        ok = alive & (idx >= 0)
        ok[ok] = tokens[idx[ok]] == tokens[L - 1 - t]
        if not ok.any():
            break
        length += ok
        alive = ok
    best = int(length.max())
    if best < min_n:
        return tokens[:0]
    cands = np.flatnonzero(length == best)
    # The most recent occurrence with k tokens after it; else the earliest (the longest
    # continuation: in a short cycle the latest occurrence is right behind the end).
    full = cands[cands + k <= L - 1]
    e = int(full[-1]) if full.size else int(cands[0])
    return tokens[e + 1:e + 1 + k]


class NgramProposer:
    """Drafts by prompt lookup (see the module docstring).

    Args:
        num_speculative_tokens: drafts per step (k >= 1).
        prompt_lookup_min / prompt_lookup_max: n-gram length range (1 <= min <= max).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # req_id -> (int64 buffer, number of valid tokens)
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def _context(self, req_id: str, token_ids: Sequence[int], new_ids: Sequence[int]) -> np.ndarray:
        """int64 view of ``token_ids + new_ids``, appending only what the cached copy lacks."""
        n_total = len(token_ids) + len(new_ids)
        buf, n = self._tokens.get(req_id, (None, 0))
        if buf is None or n > n_total or buf.shape[0] < n_total:
            cap = max(64, 2 * n_total)
            nb = np.empty(cap, dtype=np.int64)
            if buf is not None and n <= n_total:
                nb[:n] = buf[:n]
            else:
                n = 0
            buf = nb
        if n < len(token_ids):
            buf[n:len(token_ids)] = token_ids[n:]
        if new_ids:
            buf[len(token_ids):n_total] = new_ids
        # NOTE: new_ids are not yet committed (the scheduler may cut them at a stop), so the
        # cached length stops at token_ids; the next call rewrites the tail.
        self._tokens[req_id] = (buf, len(token_ids))
        return buf[:n_total]

    def propose(self, req_id: str, token_ids: Sequence[int], new_ids: Sequence[int],
                max_tokens: Optional[int] = None) -> list[int]:
        """Draft tokens to follow ``token_ids + new_ids`` (``len <= min(k, max_tokens)``)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0:
            return []
        ctx = self._context(req_id, token_ids, new_ids)
        return find_ngram_continuation(ctx, self.min_n, self.max_n, k).tolist()

    def remove(self, req_id: str) -> None:
        """Drop a finished or preempted request's state (no-op if unknown)."""
        self._tokens.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._tokens)
