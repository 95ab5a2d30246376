"""Attach a ``QuantizationConfig`` to a built model from outside, and finish it after loading.

    cfg = Int8Config()                      # or GGUFConfig(file), GPTQConfig.from_config(...), ...
    attach_quantization(model, cfg)         # before load_weights: methods create their parameters
    model.load_weights(weights)             # checkpoint tensors go through the methods' loaders
    stats = process_quantized_model(model, cfg)   # repack / quantize, tied head, model-level fusions

``quantize_model(model, "int8")`` does all three for an already loaded float model.

Layers are found by duck typing (``quant_method`` attribute of ``models.layers.Linear`` /
``Embedding``), so new architectures built from the shared layers need nothing here.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from pagedllm.quantization.base import EmbeddingMethodBase, QuantizationConfig, get_quantization_config_cls

logger = logging.getLogger("pagedllm")

#: methods applied to a float checkpoint after loading (``--quantization``)
ON_THE_FLY_METHODS = ("int8", "int4", "w8a8")


def _hookable(m: nn.Module) -> bool:
    return hasattr(type(m), "quant_method") and isinstance(m, (nn.Linear, nn.Embedding))


def _nbytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))


def attach_quantization(model: nn.Module, config: QuantizationConfig, quantize_lm_head: bool = True) -> int:
    """Give every hookable layer the method ``config`` chooses for it and let it create weights.

    Args:
        model: a built (not yet loaded) ``CausalLM``.
        config: the quantization config.
        quantize_lm_head: also quantize the LM head (False for the pooling runner).

    Returns:
        the number of layers given a method.
    """
    config.quantize_lm_head = quantize_lm_head
    dev = next(model.parameters()).device
    if config.on_the_fly and dev.type != "cpu":
        raise ValueError(f"quantization {config.name!r}: only CPU weight-only kernels are implemented (model on {dev})")
    model._quant_device = dev  # NOTE: checkpoint tensors are converted on CPU, then moved here
    n = 0
    for name, mod in list(model.named_modules()):
        if not _hookable(mod) or mod.quant_method is not None:
            continue
        method = config.get_quant_method(mod, name)
        if method is None:
            continue
        if isinstance(mod, nn.Embedding) != isinstance(method, EmbeddingMethodBase):
            raise TypeError(f"{name}: {type(method).__name__} does not fit a {type(mod).__name__}")
        mod.float_weight_bytes = mod.weight.numel() * torch.empty((), dtype=mod.weight.dtype).element_size()
        mod.quant_method = method
        method.create_weights(mod, prefix=name, params_dtype=getattr(model, "dtype", torch.float32))
        n += 1
    return n


def _tied_head(model: nn.Module, config: QuantizationConfig) -> Optional[nn.Module]:
    """A separate quantized LM head for tied embeddings, or None."""
    if not config.quantize_lm_head or getattr(model, "lm_head", "absent") is not None:
        return None
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None or not hasattr(model, "logits_processor"):
        return None
    method = config.tied_lm_head_method(model)
    if method is None:
        return None
    from pagedllm.models.layers import Linear

    vocab, hidden = embed.num_embeddings, embed.embedding_dim
    head = Linear(hidden, vocab, bias=False, device="meta")
    # NOTE: shares the embedding's tensors: the method quantizes from them or reuses them as they are
    head.weight = embed.weight
    head.quant_method = method
    method.process_weights_after_loading(head)
    return head


def process_quantized_model(model: nn.Module, config: QuantizationConfig) -> dict:
    """After ``load_weights``: each method processes its layer, a tied LM head is added
    (``model.logits_processor.tied_head``), then model-level passes run; with ``dequantize_after_load``
    every quantized layer goes back to float weights in the model dtype.

    Returns:
        ``{"method", "num_linears", "float_bytes", "quantized_bytes", ...}``: layers with a
        method, the bytes their float weights would take in the model dtype, and the bytes they
        hold now (parameters, including the tied head's own).
    """
    stats = {"method": config.name, "num_linears": 0, "float_bytes": 0, "quantized_bytes": 0}
    counted: set[int] = set()
    done: list[nn.Module] = []
    with torch.no_grad():
        for _name, mod in model.named_modules():
            if not _hookable(mod) or mod.quant_method is None:
                continue
            mod.quant_method.process_weights_after_loading(mod)
            done.append(mod)
        head = _tied_head(model, config)
        if head is not None:
            model.logits_processor.tied_head = head
            done.append(head)
        dev = getattr(model, "_quant_device", None)
        if dev is not None and dev.type != "cpu":
            for mod in done:
                mod.to(dev)
        if config.dequantize_after_load:
            for mod in done:
                _to_float(mod, getattr(model, "dtype", torch.float32))
            if head is not None:
                model.logits_processor.tied_head = None
            stats["dequantized"] = True
        else:
            stats.update(config.process_model(model))
    for mod in done:
        if mod.quant_method is None:
            continue
        stats["num_linears"] += isinstance(mod, nn.Linear)
        stats["float_bytes"] += getattr(mod, "float_weight_bytes",
                                        mod.in_features * mod.out_features * 4 if isinstance(mod, nn.Linear) else 0)
        for p in mod.parameters(recurse=False):
            if id(p) not in counted:  # NOTE: a tied head shares the embedding's tensors
                counted.add(id(p))
                stats["quantized_bytes"] += p.numel() * p.element_size()
    return stats


def _to_float(mod: nn.Module, dtype: torch.dtype) -> None:
    """Replace a processed layer's quantized parameters by its dequantized float weight."""
    qm = mod.quant_method
    w = qm.dequantize(mod)
    if w is None:
        raise ValueError(f"quantization {type(qm).__name__}: cannot dequantize this layer")
    keep = {"bias"} if isinstance(mod, nn.Linear) else set()
    for name in list(mod._parameters):
        if name not in keep:
            del mod._parameters[name]
    mod.weight = nn.Parameter(w.to(dtype).contiguous(), requires_grad=False)
    mod.quant_method = None


def quantize_model(model: nn.Module, method: str, group_size: int = 32, quantize_lm_head: bool = True) -> dict:
    """Quantize a loaded float model in place (``--quantization int8|int4|w8a8``).

    Args:
        model: a loaded ``CausalLM`` (on CPU).
        method: "int8", "int4" or "w8a8".
        group_size: int4 group size along K (must divide every K; 32 or 64 for SmolLM2).
        quantize_lm_head: also quantize the LM head (a tied embedding gets a separate quantized
            head, ``model.logits_processor.tied_head``; the table stays as is for lookups).

    Returns:
        ``process_quantized_model``'s statistics.

    Raises:
        ValueError: unknown method, a non-CPU model, or a shape the int4 kernel cannot take.
    """
    if method not in ON_THE_FLY_METHODS:
        raise ValueError(f"quantization: must be one of {list(ON_THE_FLY_METHODS)}, got {method!r}")
    cls = get_quantization_config_cls(method)
    config = cls(group_size) if method == "int4" else cls()
    attach_quantization(model, config, quantize_lm_head)
    return process_quantized_model(model, config)
