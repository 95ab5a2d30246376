"""Qwen2-MoE: Qwen2 attention (q/k/v bias = ``config.qkv_bias``) with sparse MoE layers (every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``; the others a dense MLP): ``num_experts``
experts of ``moe_intermediate_size``, top-k renormalised iff ``norm_topk_prob``, plus a shared expert
of ``shared_expert_intermediate_size`` gated by ``sigmoid(shared_expert_gate(x))``."""
from __future__ import annotations

from torch import nn

from pagedllm.models.layers import GatedMLP
from pagedllm.models.llama import LlamaForCausalLM, LlamaMoeDecoderLayer
from pagedllm.models.moe import SparseMoeBlock


def is_sparse_layer(config, layer_idx: int) -> bool:
    """transformers' rule (Qwen2-MoE, Qwen3-MoE): not in ``mlp_only_layers``, experts configured, and
    ``(layer_idx + 1) % decoder_sparse_step == 0``."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    o_bias_from_config = False
    decoder_layer = LlamaMoeDecoderLayer
    shared_expert = True

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob), act=config.hidden_act,
            shared_intermediate=config.shared_expert_intermediate_size if cls.shared_expert else None)
