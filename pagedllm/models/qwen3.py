"""Qwen3: Llama with per-head RMSNorm on q and k before rope, explicit head_dim, bias = attention_bias."""
from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
