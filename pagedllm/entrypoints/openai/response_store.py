"""The in-memory store of Responses API results (``store: true``), for ``GET
/v1/responses/{id}``, ``previous_response_id`` and background responses.

Bound: at most ``max_entries`` responses (``--responses-store-size``, default 1024; 0 turns
storing off). When full, storing one more evicts the least recently used *finished* response
(a background response still running is never evicted; if all of them are running, the new
one is refused). Counted in /metrics as ``pagedllm:responses_store_entries`` (gauge) and
``pagedllm:responses_store_evictions_total`` (counter; ``vllm:`` with ``--metrics-prefix vllm``).
The store lives in the server process and is lost when it stops.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

DEFAULT_MAX_ENTRIES = 1024
RUNNING_STATUSES = ("queued", "in_progress")


@dataclass
class StoredResponse:
    """A stored response: the ``response`` object and the conversation items that led to it
    (every input item of it and of its predecessors, without their ``instructions``)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    task: Any = None  # the asyncio task of a background response still running

    @property
    def running(self) -> bool:
        return self.response.get("status") in RUNNING_STATUSES


class ResponseStore:
    """Bounded LRU map ``response id -> StoredResponse`` (see the module docstring).

    Args:
        max_entries: the bound (0 = store nothing).
        registry: a prometheus_client CollectorRegistry for the metrics, or None.
        model_name: the ``model_name`` label of the metrics.
        prefix: the metric names' prefix ("pagedllm", or "vllm" with ``--metrics-prefix vllm``).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, registry: Any = None,
                 model_name: str = "", prefix: str = "pagedllm"):
        if max_entries < 0:
            raise ValueError(f"responses store size must be >= 0, got {max_entries}")
        self.max_entries = int(max_entries)
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0
        self._gauge = self._counter = None
        if registry is not None:
            from prometheus_client import Counter, Gauge
            self._gauge = Gauge(f"{prefix}:responses_store_entries",
                                "Responses held by the Responses API store.", ["model_name"],
                                registry=registry).labels(model_name)
            self._counter = Counter(f"{prefix}:responses_store_evictions",
                                    "Responses evicted from the full Responses API store.",
                                    ["model_name"], registry=registry).labels(model_name)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._items)

    def _update_gauge(self) -> None:
        if self._gauge is not None:
            self._gauge.set(len(self._items))

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store (or replace) an entry, evicting the least recently used finished ones while
        over the bound. Returns False (nothing stored) when storing is off or every stored
        response is still running."""
        if not self.enabled:
            return False
        with self._lock:
            if response_id in self._items:
                self._items[response_id] = entry
                self._items.move_to_end(response_id)
                return True
            while len(self._items) >= self.max_entries:
                victim = next((k for k, v in self._items.items() if not v.running), None)
                if victim is None:
                    return False
                del self._items[victim]
                self.evictions += 1
                if self._counter is not None:
                    self._counter.inc()
            self._items[response_id] = entry
            self._update_gauge()
            return True

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            entry = self._items.pop(response_id, None)
            self._update_gauge()
            return entry

    def running(self) -> list[StoredResponse]:
        with self._lock:
            return [v for v in self._items.values() if v.running]
