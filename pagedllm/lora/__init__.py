"""Multi-LoRA serving: PEFT adapters loaded per request on one base model.

``request`` (``LoRARequest``), ``peft_loader`` (PEFT adapter files -> validated weights),
``layer`` (``LoRALinear``, wrapped around the model's projections from outside), ``ops`` (the
batched shrink/expand over segments of rows sharing an adapter), ``model_manager`` (the worker's
CPU cache, device slot table and per-step mapping).
"""
from pagedllm.lora.peft_loader import LoRAAdapterError
from pagedllm.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest"]
