"""Qwen2: Llama with a bias on q/k/v (not on o_proj); sliding layers per ``config.layer_types``."""
from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias_from_config = False
