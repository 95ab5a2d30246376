"""The batched LoRA matmul: shrink then expand over segments of rows that share an adapter.

A step's rows (tokens) are ordered so that rows of one adapter are contiguous (the model runner
sorts its requests by adapter slot within the decode and the prefill groups); ``segments`` lists
``(start, end, slot)`` row ranges, one per run of rows with the same adapter (rows with no adapter
are in no segment). Per segment the delta is two GEMMs on views of the step's tensors, with no
gather or copy (Punica's SGMV "segment" formulation, https://arxiv.org/abs/2310.18547):

    out[s:e] += (x[s:e] @ a_slot.T) @ bt_slot

where ``a_slot [k, in]`` and ``bt_slot [k, out]`` are the adapter's shrink and (scaled,
block-diagonal) expand matrices (``peft_loader``). The loop runs over segments, i.e. at most
twice the number of distinct adapters in the step, never over requests.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def dequantize_rows(x, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:end`` of ``x`` as a float tensor: ``x`` itself (a view) when it is one, or the
    rows of a W8A8 ``QuantizedActivation`` (``q [M, K]`` int8, ``scale [M]``) dequantized
    (``q * scale``, the activation the base GEMM used) in ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x[start:end]
    q, scale = x.q[start:end], x.scale[start:end]
    return (q.float() * scale[:, None]).to(dtype)


def lora_segments_(out: torch.Tensor, x, weights: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]],
                   segments: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Add every segment's LoRA delta to ``out`` in place and return it.

    Args:
        out: ``[T, out]`` the base layer's output (float32/bfloat16/float16).
        x: ``[T, in]`` the layer's input: a tensor in ``out``'s dtype, or a W8A8
            ``QuantizedActivation`` (dequantized per segment).
        weights: per slot, ``(a [k, in], bt [k, out])`` of the adapter loaded there for this
            layer, or None (no adapter, or one that does not adapt this layer).
        segments: ``(start, end, slot)`` row ranges (``0 <= start < end <= T``).
    """
    for start, end, slot in segments:
        w = weights[slot]
        if w is None:
            continue
        a, bt = w
        xs = dequantize_rows(x, start, end, out.dtype)
        # NOTE: addmm_ into the view writes the rows in place; ``a.t()`` is a transposed view
        # (BLAS reads it with a transpose flag, no copy).
        out[start:end].addmm_(torch.mm(xs, a.t()), bt)
    return out


def lora_reference(x: torch.Tensor, weights: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]],
                   token_slots: Sequence[int]) -> torch.Tensor:
    """Row-by-row LoRA deltas ``[T, out]`` (float32): row ``t`` gets ``(x_t a^T) bt`` of slot
    ``token_slots[t]`` (-1: none). The test oracle for ``lora_segments_``."""
    outs = []
    width = next(w[1].shape[1] for w in weights if w is not None)
    for t, slot in enumerate(token_slots):
        w = weights[slot] if slot >= 0 else None
        if w is None:
            outs.append(torch.zeros(width))
        else:
            outs.append((x[t].float() @ w[0].float().t()) @ w[1].float())
    return torch.stack(outs) if outs else torch.zeros(0, width)
