"""Imports every quantization method module so that each registers its config by name."""
from pagedllm.quantization import awq, compressed_tensors, fp8, gguf, gptq, w8a8, weight_only  # noqa: F401
