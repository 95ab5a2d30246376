"""The model runner's encoder cache (vLLM v1's ``EncoderCacheManager`` + the runner's
``encoder_cache``, in one place): image embeddings keyed by the image's content hash, kept while a
request still has placeholder tokens of that image to compute, then evictable (least recently
used first) so that the same image in a later request is not encoded again.

Bound: ``capacity`` tokens (rows of encoder output) in total. An output that does not fit even
after evicting every unreferenced entry is used for the step and not kept (its request encodes
the image again at its next chunk): the bound is never exceeded.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional


class EncoderCache:
    """``identifier -> [tokens, hidden]`` tensor, bounded in tokens.

    Args:
        capacity: most tokens held (>= 0).

    Counters (read by ``/metrics``): ``hits``, ``misses``, ``evictions``, ``usage`` (tokens held).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"encoder_cache_size: must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.entries: OrderedDict[str, Any] = OrderedDict()
        self.refs: dict[str, set[str]] = {}  # identifier -> request ids still needing it
        self.usage = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, identifier: str) -> Optional[Any]:
        """The cached output (marked recently used) or None; counts a hit or a miss."""
        out = self.entries.get(identifier)
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(identifier)
        return out

    def put(self, identifier: str, output: Any) -> bool:
        """Keep ``output`` (``[tokens, ...]``), evicting unreferenced entries as needed; False when
        it cannot fit (then nothing is kept or evicted)."""
        n = int(output.shape[0])
        if identifier in self.entries:
            return True
        free_able = sum(int(t.shape[0]) for k, t in self.entries.items() if not self.refs.get(k))
        if n > self.capacity - self.usage + free_able:
            return False
        for k in list(self.entries):
            if self.usage + n <= self.capacity:
                break
            if not self.refs.get(k):
                self.usage -= int(self.entries.pop(k).shape[0])
                self.refs.pop(k, None)
                self.evictions += 1
        self.entries[identifier] = output
        self.usage += n
        return True

    def ref(self, identifier: str, req_id: str) -> None:
        """``req_id`` still has placeholder tokens of ``identifier`` to compute."""
        self.refs.setdefault(identifier, set()).add(req_id)

    def unref(self, identifier: str, req_id: str) -> None:
        """``req_id`` is done with ``identifier`` (its run computed, or the request left)."""
        s = self.refs.get(identifier)
        if s is not None:
            s.discard(req_id)
            if not s:
                del self.refs[identifier]

    def release_request(self, req_id: str) -> None:
        """Drop every reference of ``req_id`` (finished, aborted or preempted)."""
        for k in [k for k, s in self.refs.items() if req_id in s]:
            self.unref(k, req_id)
