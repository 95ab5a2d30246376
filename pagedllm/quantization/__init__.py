"""Weight-only quantization (``--quantization int8|int4``) of a loaded model's linear layers."""
from pagedllm.quantization.weight_only import (
    DEFAULT_INT4_GROUP_SIZE,
    QUANTIZATION_METHODS,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

__all__ = ["DEFAULT_INT4_GROUP_SIZE", "QUANTIZATION_METHODS", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear",
           "quantize_int4", "quantize_int8", "quantize_model"]
