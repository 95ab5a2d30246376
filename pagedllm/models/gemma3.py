"""Gemma 3 (text): scaled embedding, (1 + w) RMSNorms, 4 norms per layer, q/k norms, gelu-tanh,
sliding layers per ``config.layer_types`` with their own rope base, scale query_pre_attn_scalar**-0.5.

Like HF, ``attn_logit_softcapping`` is not applied (Gemma 3 checkpoints set it to None anyway);
``final_logit_softcapping`` is."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.models.base import CausalLM
from pagedllm.models.layers import Embedding, GatedMLP, RMSNorm, RotaryEmbedding, SelfAttention, residual_norm
from pagedllm.models.rope import make_rotary


class Gemma3DecoderLayer(nn.Module):
    """``x += post_attn_norm(attn(in_norm(x))); x += post_ffw_norm(mlp(pre_ffw_norm(x)))``."""

    # Which norm's output is the direct input of which projection (W8A8 fuses norm + quantize).
    norm_feeds = {"input_layernorm": "self_attn.qkv_proj", "pre_feedforward_layernorm": "mlp.gate_up_proj"}

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, head_dim: int, spec: type) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.self_attn = SelfAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim, layer_idx, rotary,
            config.query_pre_attn_scalar**-0.5, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            qk_norm=(lambda d: RMSNorm(d, eps, gemma=True)) if spec.qk_norm else None,
            sliding_window=config.sliding_window if sliding else None,
            soft_cap=config.attn_logit_softcapping if spec.attn_soft_cap else None,
        )
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, gemma=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style residual passing: returns ``(h, residual)`` with the layer output ``h + residual``."""
        h, residual = residual_norm(self.input_layernorm, x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3TextModel(nn.Module):
    """Embedding * sqrt(hidden) -> decoder layers -> final norm."""

    def __init__(self, config, spec: type) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.rotary = {t: make_rotary(config, head_dim, t) for t in sorted(set(config.layer_types))}
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        # NOTE: HF rounds the scale to the compute dtype (sqrt(640) -> 25.25 in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.rotary[config.layer_types[i]], head_dim, spec)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class Gemma3ForCausalLM(CausalLM):
    """HF ``Gemma3ForCausalLM`` (text only); logits soft-capped by ``final_logit_softcapping``."""

    qk_norm = True  # per-head (1 + w) RMSNorm of q and k
    attn_soft_cap = False  # NOTE: HF 5.24 Gemma3Attention ignores config.attn_logit_softcapping

    def build(self, config) -> nn.Module:
        return Gemma3TextModel(config, type(self))

