"""Mistral: Llama with ``config.sliding_window`` (None = off) on every layer and an explicit head_dim."""
from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    sliding_per_layer_type = False
