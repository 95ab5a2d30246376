"""Mixtral: Mistral with a sparse MoE feed-forward in every layer (``num_local_experts`` experts,
``num_experts_per_tok`` per token, top-k weights always renormalised). Checkpoint names
``block_sparse_moe.{gate, experts.N.w1/w3/w2}`` (the Hub's) or ``mlp.{gate, experts.*}`` (transformers 5)."""
from __future__ import annotations

from typing import Optional

from torch import nn

from pagedllm.models.llama import LlamaMoeDecoderLayer
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.moe import SparseMoeBlock


class MixtralForCausalLM(MistralForCausalLM):
    decoder_layer = LlamaMoeDecoderLayer

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, act=config.hidden_act)

    def _canonical_name(self, name: str) -> Optional[str]:
        name = super()._canonical_name(name)
        return None if name is None else name.replace(".block_sparse_moe.", ".mlp.")
