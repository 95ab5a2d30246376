"""Quantization of a loaded model's linear layers (``--quantization int8|int4|w8a8``).

``int8``/``int4`` are weight-only (``weight_only``); ``w8a8`` quantizes activations too, per token
and at run time, and runs int8 GEMMs (``w8a8``).
"""
from pagedllm.quantization.w8a8 import QuantizedActivation, W8A8Linear
from pagedllm.quantization.weight_only import (
    DEFAULT_INT4_GROUP_SIZE,
    QUANTIZATION_METHODS,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

__all__ = ["DEFAULT_INT4_GROUP_SIZE", "QUANTIZATION_METHODS", "QuantizedActivation", "W8A8Linear",
           "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "quantize_int4", "quantize_int8", "quantize_model"]
