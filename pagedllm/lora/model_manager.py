"""The worker's adapters: a CPU cache of loaded adapters, a device slot table of active ones, and
the per-step row -> slot mapping.

* CPU cache: at most ``max_cpu_loras`` loaded adapters (``LoRAAdapter``, CPU tensors), least
  recently used evicted first. An evicted adapter is read from its path again when a request
  needs it (the request carries its ``LoRARequest``).
* Slot table: ``max_loras`` slots on the model's device; a step's adapters must each hold one (the
  scheduler never puts more than ``max_loras`` distinct adapters in a step). A step's adapter
  without a slot takes a free one, else the least recently used slot no row of the step needs;
  activating copies its weights to the device into every wrapped layer (on a CPU device the
  cached tensors themselves are used: no copy).
* Mapping: ``prepare_step`` orders a step's requests decodes first (as the attention metadata
  needs), then by slot within each group, so one adapter's rows are contiguous, and returns the
  ``(start, end, slot)`` token ranges the layers run (``ops.lora_segments_``).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pagedllm.lora.layer import LoRALinear, wrap_lora_layers
from pagedllm.lora.peft_loader import LoRAAdapter, load_peft_adapter
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class LoRAMapping:
    """A step's adapter rows (``ForwardContext.lora_mapping``).

    Attributes:
        segments: ``(start, end, slot)`` token ranges of the step's flat batch whose rows run the
            adapter in ``slot`` (rows of requests without an adapter are in none).
        slots: the slot of each request in the (reordered) batch, -1 for none.
    """

    segments: tuple[tuple[int, int, int], ...]
    slots: tuple[int, ...]


class LoRAModelManager:
    """Adapter state of one worker (see the module docstring).

    Args:
        model: the loaded (and quantized / prepacked) model; its projections are wrapped here.
        max_loras: device slots (adapters one step may use).
        max_lora_rank: largest adapter rank accepted.
        max_cpu_loras: adapters kept loaded on the CPU (>= max_loras).
        dtype: the model's compute dtype (adapter weights are cast to it).
        device: the model's device.

    Raises:
        ValueError: ``max_loras`` / ``max_lora_rank`` < 1, or ``max_cpu_loras < max_loras``.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_lora_rank}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.model = model
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, torch.device(device)
        self.layers: dict[str, LoRALinear] = wrap_lora_layers(model, max_loras)
        self.targets = {name: layer.target for name, layer in self.layers.items()}
        self.packed_modules_mapping = dict(getattr(model, "packed_modules_mapping", {}) or {})
        self._canonical = getattr(model, "_canonical_name", None)
        self.cpu_cache: "OrderedDict[int, LoRAAdapter]" = OrderedDict()  # LRU order: oldest first
        self.slot_ids: list[Optional[int]] = [None] * max_loras  # adapter id in each slot
        self._slot_lru: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(max_loras))
        self.num_loads = 0  # adapters read from disk
        self.num_slot_swaps = 0  # adapters moved into a slot

    # ------------------------------------------------------------------ adapters
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """Read and validate ``request``'s adapter (not cached). Raises LoRAAdapterError."""
        adapter = load_peft_adapter(request, self.targets, self.packed_modules_mapping, self.max_lora_rank,
                                    self.dtype, self._canonical)
        self.num_loads += 1
        return adapter

    def add_adapter(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter into the CPU cache (a no-op when cached; the least recently
        used is evicted past ``max_cpu_loras``). Returns True when it was read from disk.

        Raises:
            LoRAAdapterError: the adapter cannot be loaded (nothing changes then).
        """
        lid = request.lora_int_id
        if lid in self.cpu_cache:
            self.cpu_cache.move_to_end(lid)
            return False
        adapter = self.load(request)
        self.cpu_cache[lid] = adapter
        while len(self.cpu_cache) > self.max_cpu_loras:
            old, _ = self.cpu_cache.popitem(last=False)
            logger.debug("LoRA: evicted adapter %d from the CPU cache", old)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from the CPU cache and its slot; True when it was held."""
        held = self.cpu_cache.pop(lora_int_id, None) is not None
        for slot, lid in enumerate(self.slot_ids):
            if lid == lora_int_id:
                self._clear_slot(slot)
                held = True
        return held

    def list_adapters(self) -> list[int]:
        """Ids in the CPU cache, least recently used first."""
        return list(self.cpu_cache)

    def stats(self) -> dict:
        """``cpu_cache_adapters`` / ``max_cpu_loras``, ``active_slots`` / ``max_loras``, and the
        cumulative ``loads`` (from disk) and ``slot_swaps``."""
        return {"cpu_cache_adapters": len(self.cpu_cache), "max_cpu_loras": self.max_cpu_loras,
                "active_slots": sum(1 for x in self.slot_ids if x is not None), "max_loras": self.max_loras,
                "loads": self.num_loads, "slot_swaps": self.num_slot_swaps}

    def max_device_bytes(self) -> int:
        """Upper bound of the slot table's device bytes: ``max_loras`` adapters of rank
        ``max_lora_rank`` on every target (for GPU memory planning)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per = sum(len(t.slices) * self.max_lora_rank * (t.in_features + t.out_features) for t in self.targets.values())
        return per * elem * self.max_loras

    # ------------------------------------------------------------------ slots
    def _clear_slot(self, slot: int) -> None:
        self.slot_ids[slot] = None
        for layer in self.layers.values():
            layer.slot_weights[slot] = None

    def _fill_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        on_cpu = self.device.type == "cpu"
        for name, layer in self.layers.items():
            w = adapter.weights.get(name)
            if w is None:
                layer.slot_weights[slot] = None
            elif on_cpu:
                layer.slot_weights[slot] = (w.a, w.bt)
            else:
                layer.slot_weights[slot] = (w.a.to(self.device, non_blocking=True),
                                            w.bt.to(self.device, non_blocking=True))
        self.slot_ids[slot] = adapter.int_id
        self.num_slot_swaps += 1

    def activate(self, requests: Sequence[LoRARequest]) -> dict[int, int]:
        """Give each of ``requests`` (distinct adapters, at most ``max_loras``) a slot, loading
        from the CPU cache (or disk) as needed; returns ``{lora_int_id: slot}``.

        Raises:
            RuntimeError: more distinct adapters than slots (a scheduler bug).
            LoRAAdapterError: an adapter evicted from the CPU cache could not be read again.
        """
        if len(requests) > self.max_loras:
            raise RuntimeError(f"a step uses {len(requests)} LoRA adapters but max_loras is {self.max_loras}")
        where = {lid: s for s, lid in enumerate(self.slot_ids) if lid is not None}
        needed = {r.lora_int_id for r in requests}
        out: dict[int, int] = {}
        for req in requests:
            lid = req.lora_int_id
            slot = where.get(lid)
            if slot is None:
                self.add_adapter(req)  # NOTE: a no-op when cached; else read again from its path
                slot = next((s for s in self._slot_lru if self.slot_ids[s] is None), None)
                if slot is None:
                    slot = next(s for s in self._slot_lru if self.slot_ids[s] not in needed)
                    del where[self.slot_ids[slot]]
                self._fill_slot(slot, self.cpu_cache[lid])
                where[lid] = slot
            elif lid in self.cpu_cache:
                self.cpu_cache.move_to_end(lid)
            self._slot_lru.move_to_end(slot)
            out[lid] = slot
        return out

    # ------------------------------------------------------------------ steps
    def prepare_step(self, reqs: list[Any]) -> tuple[list[Any], Optional[LoRAMapping]]:
        """Order a step's requests and build its mapping.

        Args:
            reqs: the step's ``ScheduledRequest``s, decodes (one token, or drafts to verify) first;
                each with ``lora_request`` (a LoRARequest or None), ``num_tokens`` (drafts
                included) and ``spec_token_ids``.

        Returns:
            ``(reqs, None)`` unchanged when no request has an adapter; else the requests
            reordered (decodes first, then by slot within each group; requests without an
            adapter last in their group) and the step's ``LoRAMapping``.
        """
        adapters: dict[int, LoRARequest] = {}
        for r in reqs:
            lr = r.lora_request
            if lr is not None:
                adapters.setdefault(lr.lora_int_id, lr)
        if not adapters:
            return reqs, None
        slot_of = self.activate(list(adapters.values()))
        none = self.max_loras

        def key(r: Any) -> tuple[bool, int]:
            lr = r.lora_request
            # NOTE: the runner's decode group: one new token, or drafts to verify (one-token
            # attention rows each; ``model_runner._decodes_first``)
            prefill = r.num_tokens != 1 and not getattr(r, "spec_token_ids", None)
            return (prefill, none if lr is None else slot_of[lr.lora_int_id])

        reqs = sorted(reqs, key=key)
        segments: list[tuple[int, int, int]] = []
        slots: list[int] = []
        pos = 0
        for r in reqs:
            lr = r.lora_request
            slot = -1 if lr is None else slot_of[lr.lora_int_id]
            slots.append(slot)
            end = pos + r.num_tokens
            if slot >= 0:
                if segments and segments[-1][2] == slot and segments[-1][1] == pos:
                    segments[-1] = (segments[-1][0], end, slot)
                else:
                    segments.append((pos, end, slot))
            pos = end
        return reqs, LoRAMapping(tuple(segments), tuple(slots))
