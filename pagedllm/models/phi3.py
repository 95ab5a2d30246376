"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama with checkpoint-fused ``qkv_proj`` / ``gate_up_proj``
(loaded as they are: same names and row order as our fused layers), longrope scaling, partial
rotary (``partial_rotary_factor``) and ``config.sliding_window`` on every layer."""
from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    sliding_per_layer_type = False
