"""Pipeline parallelism applied to a built model from outside: each stage keeps a contiguous
range of decoder layers (vLLM's ``PPMissingLayer`` idea; model files are untouched).

``shard_pipeline(model, rank, size)`` (before loading):

* layers of other stages become ``MissingLayer`` (pass ``(x, residual)`` through), so checkpoint
  names stay global and the model's own loop runs unchanged; their tensors are skipped at load
  (``model.weight_name_filter``); the kept layers' attention ``layer_idx`` is renumbered from 0
  (one KV cache per local layer);
* stages after the first: the embedding becomes ``MissingEmbedding`` (zeros; the last stage of a
  tied model keeps the real table for its LM head) and the first local layer receives the
  previous stage's hidden state (a forward pre-hook);
* stages before the last: the final norm becomes ``SendToNextStage``, which sends
  ``x + residual`` to the next stage and returns it; ``compute_logits`` returns None there.

Why ``x + residual`` is enough: a decoder layer given ``residual=None`` computes
``norm(x)`` with ``residual = x``, and given a residual ``norm(x + residual)`` with
``residual = x + residual``: the same values, one add in the same dtype.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.distributed.tensor_parallel import split_range


class _NoAttention(nn.Module):
    qkv_proj = None


class MissingLayer(nn.Module):
    """A decoder layer held by another stage: ``(positions, x, residual) -> (x, residual)``.

    NOTE: ``self_attn.qkv_proj`` is None for model code that inspects ``layers[0]`` (the Llama
    fused-decode check), which then finds nothing to fuse.
    """

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _NoAttention()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor]):
        return x, residual


class MissingEmbedding(nn.Module):
    """The embedding on a stage that receives its input: ids ``[T]`` -> zeros ``[T, hidden]``."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden, self.dtype = hidden, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape[0], self.hidden, dtype=self.dtype, device=ids.device)


class SendToNextStage(nn.Module):
    """Replaces the final norm on a stage before the last: ``(x, residual) -> (x + residual,
    None)``, sending the sum to the next stage (asynchronously; the previous send is waited for
    first, so at most one is in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: Any = None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        h = x if residual is None else x + residual
        if self._pending is not None:
            self._pending[0].wait()
        h = h.contiguous()
        self._pending = (get_pp_group().send_next(h), h)
        return h, None


def _receive_hook(hidden: int, dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple):
        positions = args[0]
        x = get_pp_group().recv_prev((positions.shape[0], hidden), dtype, positions.device)
        return (positions, x, None)
    return hook


def shard_pipeline(model: nn.Module, rank: int, size: int) -> tuple[int, int]:
    """Keep this stage's layers of ``model`` (see the module docstring), in place, before
    ``load_weights``; returns ``(first layer, layer count)``.

    Raises:
        ValueError: fewer layers than stages, or a model without the ``model.layers`` /
            ``model.embed_tokens`` / ``model.norm`` structure of the shared layers.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        raise ValueError(f"pipeline_parallel_size: {type(model).__name__} has no model.layers / embed_tokens / norm")
    n = len(layers)
    if n < size:
        raise ValueError(f"pipeline_parallel_size: {size} stages for {n} layers")
    start, count = split_range(n, size, rank)
    first, last = rank == 0, rank == size - 1
    embed = inner.embed_tokens
    hidden, dtype = embed.embedding_dim, embed.weight.dtype
    for i in range(n):
        if not start <= i < start + count:
            layers[i] = MissingLayer()
    for m in inner.modules():
        if isinstance(m, Attention):
            m.layer_idx -= start
    keep_embed = first or (last and getattr(model, "lm_head", None) is None)
    if not first:
        layers[start].register_forward_pre_hook(_receive_hook(hidden, dtype))
        if not keep_embed:
            inner.embed_tokens = MissingEmbedding(hidden, dtype)
    if not last:
        inner.norm = SendToNextStage()
        model.lm_head = None  # NOTE: load_weights then skips lm_head.weight

    def keep(name: str) -> bool:
        if name.startswith("model.layers."):
            i = int(name.split(".", 3)[2])
            return start <= i < start + count
        if name.startswith("model.embed_tokens."):
            return keep_embed
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return last
        return True

    model.weight_name_filter = keep
    model.pp_stage = (rank, size, start, count)
    return start, count


def install_pipeline_comm(model: nn.Module) -> None:
    """After loading: stages before the last compute no logits (``compute_logits`` -> None)."""
    rank, size, _, _ = model.pp_stage
    if rank != size - 1:
        model.logits_processor.emits_logits = False
