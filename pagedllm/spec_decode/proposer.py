"""The proposer interface the worker calls once per step, after sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class ProposeBatch:
    """One step, seen by a proposer.

    Attributes:
        reqs: the step's ScheduledRequests in the runner's batch order (``token_ids`` are the
            committed tokens, without this step's new ones).
        sampled: req_id -> tokens emitted this step (accepted drafts + one), for requests that
            sampled.
        want: req_ids to draft for this step (empty when speculation is switched off for the
            step; model proposers still run over every request to keep their KV caches current).
        hidden: ``[T, H]`` the target's last hidden states of the step's tokens (row order of
            the forward: ``qsl``), or None.
        qsl: int64 numpy ``[B + 1]`` query start offsets of ``reqs`` in ``hidden``.
        aux_hidden: target hidden states captured at extra layers (EAGLE-3), or None.
        max_drafts: req_id -> most drafts worth proposing (``max_tokens`` room, ``max_model_len``).
    """

    reqs: list[Any]
    sampled: dict[str, list[int]]
    want: set[str]
    hidden: Optional[torch.Tensor] = None
    qsl: Optional[np.ndarray] = None
    aux_hidden: Optional[list[torch.Tensor]] = None
    max_drafts: dict[str, int] = field(default_factory=dict)


@dataclass
class Proposal:
    """Drafts for the next step.

    Attributes:
        token_ids: req_id -> draft tokens (absent or empty: no drafts).
        probs: req_id -> float32 ``[len(drafts), V]`` the distribution each draft was drawn from,
            for proposers that sample (None or absent: one-hot, i.e. deterministic drafts).
    """

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


class Proposer:
    """Base class: ``propose`` once per step, ``remove`` when a request leaves the batch."""

    #: extra KV slots the scheduler allocates past a decoding request's tokens.
    num_lookahead_tokens = 0
    #: whether ``ProposeBatch.hidden`` is needed.
    needs_hidden = False

    def propose(self, batch: ProposeBatch) -> Proposal:  # pragma: no cover - interface
        raise NotImplementedError

    def remove(self, req_id: str, finished: bool = True) -> None:
        """Drop the request's state (``finished`` False: preempted, it will come back)."""

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics (cache sizes), name -> value."""
        return {}


class PagedModelProposer(Proposer):
    """A proposer running a model of its own (a draft model, an EAGLE head) over paged KV caches
    with the target's block geometry, drafting ``k`` tokens a step (so ``k`` lookahead slots).

    Args:
        num_speculative_tokens: ``k``.
        kv_spec: the drafting model's ``(num_layers, num_kv_heads, head_dim)``: one cache a layer.
        num_blocks / block_size: the target's KV cache geometry.
        kv_cache_dtype: the caches' dtype.
        device: torch device.
        attn_impl: the attention backend.
    """

    def __init__(self, num_speculative_tokens: int, kv_spec: tuple[int, int, int], num_blocks: int,
                 block_size: int, kv_cache_dtype: torch.dtype, device: torch.device, attn_impl: Any) -> None:
        from pagedllm.worker.kv_memory import new_kv_cache

        self.k = self.num_lookahead_tokens = num_speculative_tokens
        self.block_size, self.device, self.attn_impl = block_size, device, attn_impl
        num_layers, num_kv_heads, head_dim = kv_spec
        self.kv_caches = [new_kv_cache((num_blocks, 2, block_size, num_kv_heads, head_dim), kv_cache_dtype, device)
                          for _ in range(num_layers)]


class TokenProposer(Proposer):
    """Adapter for proposers that only read token ids (n-gram, suffix): one call per request."""

    def __init__(self, impl: Any, uses_prompt_len: bool) -> None:
        self.impl = impl
        self.uses_prompt_len = uses_prompt_len

    def propose(self, batch: ProposeBatch) -> Proposal:
        out = Proposal()
        for r in batch.reqs:
            new = batch.sampled.get(r.req_id)
            if not new or r.req_id not in batch.want:
                continue
            cap = batch.max_drafts.get(r.req_id)
            if self.uses_prompt_len:
                d = self.impl.propose(r.req_id, r.token_ids, new, r.prompt_len, max_tokens=cap)
            else:
                d = self.impl.propose(r.req_id, r.token_ids, new, max_tokens=cap)
            if d:
                out.token_ids[r.req_id] = d
        return out

    def remove(self, req_id: str, finished: bool = True) -> None:
        if self.uses_prompt_len:
            self.impl.remove(req_id, finished)
        else:
            self.impl.remove(req_id)

    def stats(self) -> dict[str, float]:
        if hasattr(self.impl, "global_trie"):
            return {"suffix_cached_requests": self.impl.num_cached_requests,
                    "suffix_global_tree_nodes": self.impl.global_trie.num_nodes}
        return {}
