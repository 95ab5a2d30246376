"""Granite (3.x): Llama with four scalars from the config: ``embedding_multiplier`` (embeddings),
``residual_multiplier`` (each block's output before the residual add), ``attention_multiplier``
(the softmax scale) and ``logits_scaling`` (logits are divided by it)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.models.layers import residual_norm
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    """``x += m * attn(norm(x)); x += m * mlp(norm(x))`` with ``m = residual_multiplier``."""

    def __init__(self, config, layer_idx: int, rotary, head_dim: int, spec: type) -> None:
        super().__init__(config, layer_idx, rotary, head_dim, spec)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(h, residual)`` with the layer output ``h + residual`` (as ``LlamaDecoderLayer``)."""
        h, residual = residual_norm(self.input_layernorm, x, residual)
        h = self.self_attn(positions, h) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    """Embedding * ``embedding_multiplier`` -> decoder layers -> final norm."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids) * self.embedding_multiplier, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteDecoderLayer

    @classmethod
    def attn_scale(cls, config, head_dim: int) -> float:
        return float(config.attention_multiplier)

    def build(self, config) -> nn.Module:
        model = GraniteModel(config, type(self))
        model.embedding_multiplier = float(config.embedding_multiplier)
        return model

    @classmethod
    def logits_scaling(cls, config) -> float:
        """The logits are divided by ``config.logits_scaling``."""
        return config.logits_scaling
