"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm, bias = ``config.attention_bias``,
``config.sliding_window`` on every layer when ``use_sliding_window``) with Qwen2-MoE's sparse layers
without the shared expert."""
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    o_bias_from_config = True
    qk_norm = True
    sliding_per_layer_type = False
    shared_expert = False
