"""The attention module models use: forwards to the active backend via the forward context."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.backend import get_forward_context


class Attention(nn.Module):
    """Paged attention over this layer's KV cache (``ctx.kv_caches[layer_idx]``).

    Args:
        num_heads: query heads Hq; head_dim: D; scale: softmax scale;
        num_kv_heads: Hkv (Hq % Hkv == 0); layer_idx: index into the forward context's caches;
        sliding_window: a query at position p sees keys > p - window (None = all);
        logits_soft_cap: scores become ``cap * tanh(scores / cap)`` (None = off).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.layer_idx = num_kv_heads, layer_idx
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, Hq*D]``, k/v ``[T, Hkv*D]`` (rope already applied) -> ``[T, Hq*D]`` in q's dtype."""
        t = q.shape[0]
        ctx = get_forward_context()
        out = ctx.impl.forward(
            q.reshape(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx] if ctx.kv_caches else None,
            ctx.attn_metadata,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
        )
        return out.reshape(t, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"window={self.sliding_window}, soft_cap={self.logits_soft_cap}")
