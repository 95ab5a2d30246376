"""Llama (and the Llama-shaped Qwen2/Qwen3): pre-norm decoder, GQA, rope, SiLU gated MLP."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.models.base import CausalLM
from pagedllm.models.layers import Embedding, GatedMLP, RMSNorm, RotaryEmbedding, SelfAttention, rope_inv_freq


class LlamaDecoderLayer(nn.Module):
    """``x += attn(norm(x)); x += mlp(norm(x))``; options come from the model class."""

    # Which norm's output is the direct input of which projection (W8A8 fuses norm + quantize).
    norm_feeds = {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate_up_proj"}

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, head_dim: int, spec: type) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        attn_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim, layer_idx,
            rotary, head_dim**-0.5, qkv_bias=spec.qkv_bias or attn_bias, o_bias=attn_bias and spec.o_bias_from_config,
            qk_norm=(lambda d: RMSNorm(d, eps)) if spec.qk_norm else None,
            sliding_window=config.sliding_window if sliding else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style residual passing: returns ``(h, residual)`` with the layer output ``h + residual``.

        The adds are folded into the next norm (``RMSNorm.forward(x, residual)``).
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding -> decoder layers -> final norm. ``forward(ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, config, spec: type) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(head_dim, *rope_inv_freq(config, head_dim))
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, head_dim, spec) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._fused: tuple = (None, None)  # ((first qkv module, its packed weight) when built, FusedDecode or None)

    def _fused_decode(self):
        """The ``FusedDecode`` plan of this model, or None; rebuilt when quantization or
        prepacking has swapped the projections' weights since it was last built."""
        qkv = self.layers[0].self_attn.qkv_proj if len(self.layers) else None
        # NOTE: prepacking swaps a Linear's weight in place, quantization sets its method
        key = (qkv, getattr(qkv, "_packed", None), getattr(qkv, "quant_method", None))
        old = self._fused[0]
        if old is None or any(a is not b for a, b in zip(old, key)):
            from pagedllm.models.fused_decode import FusedDecode

            self._fused = (key, FusedDecode.build(self))
        return self._fused[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        fused = self._fused_decode()
        if fused is not None:
            out = fused.run(x, positions)  # a decode-only step on CPU: one C++ call
            if out is not None:
                return out
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """HF ``LlamaForCausalLM``: q/k/v/o bias = ``config.attention_bias``, mlp bias = ``config.mlp_bias``."""

    qkv_bias = False  # always-on q/k/v bias (Qwen2)
    o_bias_from_config = True  # o_proj bias follows config.attention_bias
    qk_norm = False  # per-head RMSNorm of q and k before rope (Qwen3)

    def build(self, config) -> nn.Module:
        return LlamaModel(config, type(self))
