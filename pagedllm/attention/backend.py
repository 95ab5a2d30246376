"""Attention backend interface: per-step metadata and the forward context.

A step's batch is a flat run of ``T`` tokens from ``B`` requests, ordered by request;
requests with one new token (decodes) come first, then requests computing several
(prefill chunks, possibly with earlier context already in the KV cache).

KV cache layout (per layer): ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``;
index 0 of dim 1 is K, 1 is V. A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch


@dataclass
class AttentionMetadata:
    """Inputs every attention layer of one forward pass shares.

    Attributes:
        num_reqs: B.
        num_decodes: requests ``0..num_decodes-1`` have exactly one query token.
        num_decode_tokens: == num_decodes.
        query_start_loc: int64 ``[B + 1]``, cumulative query lengths (token offsets in the batch).
        query_lens: python list of B ints.
        seq_lens: int64 ``[B]``: context length after this step (tokens in cache + new ones).
        seq_lens_list: python list of the same.
        block_tables: int64 ``[B, max_blocks]`` (rows padded with 0).
        slot_mapping: int64 ``[T]`` flat slot of every new token; -1 = padding, not written.
        block_size: tokens per block.
        max_seq_len: max(seq_lens).
        bidirectional_ranges: per request, the ``[start, end)`` position ranges (image placeholder
            runs of a model with ``mm_bidirectional``) whose tokens also see each other's later keys
            (prefill only; a chunk never ends inside one); None = causal everywhere.
    """

    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    query_start_loc: torch.Tensor
    query_lens: list[int]
    seq_lens: torch.Tensor
    seq_lens_list: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    max_seq_len: int
    bidirectional_ranges: Optional[list[Optional[list[tuple[int, int]]]]] = None


class AttentionImpl:
    """One backend's attention computation (``torch_paged`` on CPU, ``triton_paged`` on CUDA).

    ``forward`` is the contract the layers call; a backend implements its two steps,
    ``write_kv`` (store the step's new K/V in the paged cache) and ``attend`` (attention of every
    query token over its cached context).
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Optional[AttentionMetadata],
        scale: float,
        sliding_window: Optional[int],
        logits_soft_cap: Optional[float],
    ) -> torch.Tensor:
        """Write new K/V into ``kv_cache`` and attend.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]`` (compute dtype).
            kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
            meta: the step's metadata; None for a dummy/profiling run: the batch is then treated
                as one causal sequence (the torch prefill path) and nothing is written.
            scale: softmax scale (usually head_dim ** -0.5).
            sliding_window: a query at position p sees keys at positions > p - window; None = all.
            logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)``.

        Returns:
            ``[T, num_heads, head_dim]``.
        """
        if meta is None:
            # NOTE: imported here: torch_paged imports this module.
            from pagedllm.attention.torch_paged import causal_attention
            return causal_attention(q, k, v, scale, sliding_window, logits_soft_cap)
        # NOTE: all writes come first, so a request may read blocks another request of the
        # same step wrote (e.g. a prefix-cache block shared within one step).
        self.write_kv(kv_cache, k, v, meta)
        return self.attend(q, k, v, kv_cache, meta, scale, sliding_window, logits_soft_cap)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store ``k``/``v`` ``[T, Hkv, D]`` at ``meta.slot_mapping`` (-1 = padding, skipped)."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: Optional[int], logits_soft_cap: Optional[float]) -> torch.Tensor:
        """The attention of ``forward`` once ``write_kv`` stored the step's K/V (same arguments)."""
        raise NotImplementedError


@dataclass
class ForwardContext:
    """Per-forward state every attention layer reads: metadata, KV caches, backend.

    ``lora_mapping``: the step's LoRA rows (``pagedllm.lora.model_manager.LoRAMapping``), read
    by the LoRA-wrapped projections; None when no row of the step runs an adapter (paths that
    cannot add LoRA deltas, such as the fused decode step, run only then).
    """

    attn_metadata: Optional[AttentionMetadata]
    kv_caches: list[torch.Tensor]
    impl: AttentionImpl
    lora_mapping: Any = None
    # Prompt embeddings of the step (``--enable-prompt-embeds``): ``(rows int64 [R], embeds
    # [R, hidden])``, the flat token rows whose input embedding is ``embeds`` instead of the
    # lookup of their (placeholder) ids; the model's ``Embedding`` applies it. None = none.
    inputs_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # Image embeddings of the step: ``(rows int64 [R], embeds [R, hidden])``, the flat token rows
    # (image placeholders) that take encoder outputs; applied by a multimodal model where its
    # architecture puts them (Gemma 3: after the embedding scale). None = none.
    mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None


_forward_context: Optional[ForwardContext] = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install ``ctx`` for the duration of one model forward.

    Raises:
        RuntimeError: if a forward context is already set (nesting is refused).
    """
    global _forward_context
    if _forward_context is not None:
        raise RuntimeError("set_forward_context: a forward context is already active")
    _forward_context = ctx
    try:
        yield ctx
    finally:
        _forward_context = None


def current_forward_context() -> Optional[ForwardContext]:
    """The active forward context, or None outside ``set_forward_context``."""
    return _forward_context


def get_forward_context() -> ForwardContext:
    """Return the active forward context.

    Raises:
        RuntimeError: outside ``set_forward_context``.
    """
    if _forward_context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return _forward_context
