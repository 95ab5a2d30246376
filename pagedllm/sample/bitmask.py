"""Grammar token bitmasks applied to logits (structured outputs).

Format (xgrammar's, llguidance's and vLLM's): int32 ``[M, W]`` with ``W = ceil(V / 32)``; bit
``j`` of word ``w`` set = token ``32 * w + j`` allowed. Plain torch ops, so the same code runs on
CPU and CUDA tensors.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[M, vocab_size]``: True = allowed. Ids past ``32 * W`` are not allowed."""
    m, w = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.bool).reshape(m, w * 32)
    if w * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((m, vocab_size - w * 32), dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the disallowed tokens of ``logits[rows[i]]`` to -inf, in place.

    Args:
        logits: float ``[N, V]``.
        rows: int64 ``[M]``, distinct row indices into ``logits``.
        bitmask: int32 ``[M, ceil(V / 32)]`` on ``logits``' device; row i belongs to ``rows[i]``.
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows.numel() == logits.shape[0] and bool((rows == torch.arange(
            rows.numel(), device=rows.device)).all()):
        logits.masked_fill_(~allowed, _NEG_INF)
        return
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, rows, sub)
