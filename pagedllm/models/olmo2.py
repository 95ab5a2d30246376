"""OLMo 2: post-norm decoder (``x += norm(attn(x)); x += norm(mlp(x))``, no input norm) with
RMSNorms of q and k over all heads (before rope); otherwise Llama."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.models.layers import GatedMLP, RMSNorm, SelfAttention
from pagedllm.models.llama import LlamaForCausalLM


class Olmo2DecoderLayer(nn.Module):
    """``x += post_attn_norm(attn(x)); x += post_ff_norm(mlp(x))``."""

    def __init__(self, config, layer_idx: int, rotary, head_dim: int, spec: type) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim, layer_idx,
            rotary, head_dim**-0.5, qkv_bias=bias, o_bias=bias, qk_norm=lambda d: RMSNorm(d, eps),
            qk_norm_per_head=False)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as ``LlamaDecoderLayer``: returns ``(h, residual)``, layer output ``h + residual``."""
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions, x))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
