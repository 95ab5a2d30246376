"""OLMoE: Llama-style pre-norm layers with RMSNorms of q and k over all heads, optional ``clip_qkv``,
and a sparse MoE feed-forward in every layer (``num_experts`` of ``intermediate_size``, top-k
renormalised iff ``norm_topk_prob``)."""
from __future__ import annotations

from torch import nn

from pagedllm.models.llama import LlamaForCausalLM, LlamaMoeDecoderLayer
from pagedllm.models.moe import SparseMoeBlock


class OlmoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    qk_norm_per_head = False
    sliding_per_layer_type = False
    decoder_layer = LlamaMoeDecoderLayer

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=bool(config.norm_topk_prob),
                              act=config.hidden_act)
