"""Which ``QuantizationConfig`` a checkpoint loads with: its own format, or the ``--quantization`` flag.

| checkpoint | ``quantization`` | result |
|---|---|---|
| GGUF with quantized tensors | None / "gguf" | ``GGUFConfig``: blocks kept quantized where a kernel runs them |
| GGUF | "none" | None: every tensor dequantized at load (gguf-py, bit-exact) to ``dtype`` |
| GGUF or float HF directory | "int8" / "int4" / "w8a8" | re-quantized after loading the float weights |
| HF directory with ``quantization_config`` | None or its own ``quant_method`` | that format (GPTQ, AWQ, compressed-tensors, FP8) |
| HF directory with ``quantization_config`` | "none" | that format, dequantized to ``dtype`` after loading |
| float HF directory | None / "none" | None |

Anything else (an unknown ``quant_method``, a flag that does not match the checkpoint) is a
``ValueError`` naming it: a quantized checkpoint is never loaded silently as something else.
"""
from __future__ import annotations

from typing import Any, Optional

#: values of ``--quantization`` beyond the registered method names
NONE = "none"


def _as_dict(qc: Any) -> dict:
    if isinstance(qc, dict):
        return dict(qc)
    to_dict = getattr(qc, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(qc))


def checkpoint_quant_method(hf_config: Any) -> Optional[str]:
    """The ``quant_method`` of an HF config's ``quantization_config`` (normalised: lower case,
    ``compressed_tensors`` -> ``compressed-tensors``), or None when it has none."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = _as_dict(qc).get("quant_method")
    if not method:
        raise ValueError("config.json: quantization_config has no 'quant_method'")
    return str(method).lower().replace("_", "-")


def resolve_quant_config(source: str, hf_config: Any, quantization: Optional[str], gguf_file: Any = None):
    """The quantization config to load with (None = plain float weights in the model dtype).

    Args:
        source: "gguf" or "hf".
        hf_config: the model config (HF: may carry ``quantization_config``).
        quantization: the ``--quantization`` value, or None.
        gguf_file: the opened ``GGUFFile`` (GGUF only).

    Raises:
        ValueError: an unknown or unsupported method or option, or a flag that does not match
            the checkpoint's own format.
    """
    from pagedllm.quantization.base import get_quantization_config_cls, registered_methods

    # NOTE: from the registry (each config's ``on_the_fly``), so a newly registered method needs nothing here
    ON_THE_FLY_METHODS = tuple(m for m in registered_methods() if get_quantization_config_cls(m).on_the_fly)
    q = quantization.lower() if isinstance(quantization, str) else quantization
    if q is not None and q != NONE and q not in registered_methods():
        raise ValueError(f"quantization: {quantization!r} is not supported; supported: "
                         f"{registered_methods() + [NONE]}")
    if source == "gguf":
        if q in ON_THE_FLY_METHODS:
            return get_quantization_config_cls(q)()
        if q == NONE:
            return None
        if q not in (None, "gguf"):
            raise ValueError(f"quantization: {quantization!r} cannot load a GGUF file (use 'gguf', the default, "
                             f"'none' to dequantize at load, or one of {list(ON_THE_FLY_METHODS)} to re-quantize)")
        from pagedllm.quantization.gguf import GGUFConfig

        cfg = GGUFConfig.from_gguf(gguf_file)
        return cfg if cfg.has_quantized_tensors() else None
    method = checkpoint_quant_method(hf_config)
    if method is None:
        if q in (None, NONE):
            return None
        if q in ON_THE_FLY_METHODS:
            return get_quantization_config_cls(q)()
        raise ValueError(f"quantization: {quantization!r} needs a checkpoint in that format, but config.json has no "
                         f"quantization_config (to quantize float weights at load use one of "
                         f"{list(ON_THE_FLY_METHODS)})")
    if method in ON_THE_FLY_METHODS or method == "gguf" or method not in registered_methods():
        raise ValueError(f"config.json: quantization_config quant_method {method!r} is not supported; supported "
                         f"checkpoint formats: {[m for m in registered_methods() if m not in ON_THE_FLY_METHODS + ('gguf',)]}")
    if q not in (None, NONE, method):
        raise ValueError(f"quantization: {quantization!r} does not match the checkpoint's quantization_config "
                         f"quant_method {method!r} (omit --quantization, or use 'none' to dequantize at load)")
    cfg = get_quantization_config_cls(method).from_config(_as_dict(hf_config.quantization_config))
    cfg.dequantize_after_load = q == NONE
    return cfg
