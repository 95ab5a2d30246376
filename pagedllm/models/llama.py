"""Llama (and the Llama-shaped Qwen2/Qwen3, Mistral, Phi-3, ...): pre-norm decoder, GQA, rope, SiLU
gated MLP. Subclasses change class attributes (the "spec") or the MLP / decoder layer."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.models.base import CausalLM
from pagedllm.models.layers import Embedding, GatedMLP, RMSNorm, RotaryEmbedding, SelfAttention, residual_norm
from pagedllm.models.rope import make_rotary


def layer_sliding_window(config, layer_idx: int, per_layer_type: bool = True) -> Optional[int]:
    """The sliding window of layer ``layer_idx`` as transformers applies it: from
    ``config.layer_types`` when the model reads them (``per_layer_type``), else
    ``config.sliding_window`` on every layer (Mistral, Phi-3, Mixtral, Qwen3-MoE); None = full."""
    layer_types = getattr(config, "layer_types", None) if per_layer_type else None
    if layer_types is not None:
        return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


class LlamaDecoderLayer(nn.Module):
    """``x += attn(norm(x)); x += mlp(norm(x))``; options come from the model class."""

    # Which norm's output is the direct input of which projection (W8A8 fuses norm + quantize).
    norm_feeds = {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate_up_proj"}

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, head_dim: int, spec: type) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        attn_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim, layer_idx,
            rotary, spec.attn_scale(config, head_dim),
            qkv_bias=spec.qkv_bias or attn_bias or bool(getattr(config, "qkv_bias", False)),
            o_bias=attn_bias and spec.o_bias_from_config,
            qk_norm=(lambda d: RMSNorm(d, eps)) if spec.qk_norm else None, qk_norm_per_head=spec.qk_norm_per_head,
            sliding_window=layer_sliding_window(config, layer_idx, spec.sliding_per_layer_type),
            clip_qkv=getattr(config, "clip_qkv", None),
        )
        self.mlp = spec.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style residual passing: returns ``(h, residual)`` with the layer output ``h + residual``.

        The adds are folded into the next norm (``RMSNorm.forward(x, residual)``).
        """
        h, residual = residual_norm(self.input_layernorm, x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaMoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose MLP may be a sparse MoE block (``models/moe.py``): only the input norm
    feeds a projection directly (W8A8 fuses no norm into the experts)."""

    norm_feeds = {"input_layernorm": "self_attn.qkv_proj"}


class LlamaModel(nn.Module):
    """Embedding -> decoder layers -> final norm. ``forward(ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, config, spec: type) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = make_rotary(config, head_dim)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        layer_cls = spec.decoder_layer or LlamaDecoderLayer
        self.layers = nn.ModuleList(
            layer_cls(config, i, self.rotary, head_dim, spec) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """HF ``LlamaForCausalLM``: q/k/v/o bias = ``config.attention_bias``, mlp bias = ``config.mlp_bias``."""

    qkv_bias = False  # always-on q/k/v bias (Qwen2)
    o_bias_from_config = True  # o_proj bias follows config.attention_bias
    qk_norm = False  # RMSNorm of q and k before rope (Qwen3)
    qk_norm_per_head = True  # False: the q/k norms span all heads (OLMo 2, OLMoE)
    sliding_per_layer_type = True  # False: config.sliding_window applies to every layer (Mistral, ...)
    decoder_layer: Optional[type] = None  # None = LlamaDecoderLayer

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (MoE models return a sparse block)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        bias=bool(getattr(config, "mlp_bias", False)))

    @classmethod
    def attn_scale(cls, config, head_dim: int) -> float:
        """Softmax scale of the attention scores."""
        return head_dim**-0.5

    def build(self, config) -> nn.Module:
        return LlamaModel(config, type(self))
