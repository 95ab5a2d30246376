"""Quantization: one ``QuantizationConfig`` + method class per format, registered by name
(``pagedllm.quantization.base``), attached to a built model from outside
(``pagedllm.quantization.apply``).

Formats: ``int8`` / ``int4`` (weight-only, quantized at load, ``weight_only``), ``w8a8`` (int8
weights and dynamic per-token int8 activations, ``w8a8``).
"""
from pagedllm.quantization.apply import (
    ON_THE_FLY_METHODS,
    attach_quantization,
    process_quantized_model,
    quantize_model,
)
from pagedllm.quantization.base import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    get_quantization_config_cls,
    register_quantization_config,
    registered_methods,
)
from pagedllm.quantization.w8a8 import QuantizedActivation, W8A8Config, W8A8Linear, W8A8LinearMethod
from pagedllm.quantization.weight_only import (
    DEFAULT_INT4_GROUP_SIZE,
    Int4Config,
    Int4LinearMethod,
    Int8Config,
    Int8LinearMethod,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    quantize_int4,
    quantize_int8,
)

#: the on-the-fly methods (kept for callers of the old name)
QUANTIZATION_METHODS = ON_THE_FLY_METHODS

__all__ = ["DEFAULT_INT4_GROUP_SIZE", "EmbeddingMethodBase", "Int4Config", "Int4LinearMethod", "Int8Config",
           "Int8LinearMethod", "LinearMethodBase", "ON_THE_FLY_METHODS", "QUANTIZATION_METHODS",
           "QuantizationConfig", "QuantizedActivation", "UnquantizedLinearMethod", "W8A8Config", "W8A8Linear",
           "W8A8LinearMethod", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "attach_quantization",
           "get_quantization_config_cls", "process_quantized_model", "quantize_int4", "quantize_int8",
           "quantize_model", "register_quantization_config", "registered_methods"]
