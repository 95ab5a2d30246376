"""The bounded LRU of compiled grammars (futures, so concurrent requests share one compile)."""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from typing import Hashable, Optional


class GrammarCache:
    """At most ``capacity`` entries, least recently used evicted first. Not thread-safe (the
    manager holds its lock around every call).

    Args:
        capacity: most entries kept (>= 1).

    Attributes:
        evictions: entries dropped to stay within ``capacity`` so far.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"grammar_cache_size: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: "OrderedDict[Hashable, Future]" = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Optional[Future]:
        """The entry for ``key`` (now the most recently used), or None."""
        fut = self._entries.get(key)
        if fut is not None:
            self._entries.move_to_end(key)
        return fut

    def put(self, key: Hashable, fut: Future) -> None:
        """Insert (or replace) ``key``, evicting the least recently used beyond capacity.

        NOTE: an evicted grammar stays alive while requests use it (they hold the future)."""
        self._entries[key] = fut
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
