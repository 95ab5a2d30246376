"""The quantization interface (vLLM's ``QuantizationConfig`` / ``LinearMethodBase`` shape).

A ``QuantizationConfig`` describes how a checkpoint's (or the ``--quantization`` flag's) weights are
stored; it comes from a checkpoint's ``quantization_config`` (``from_config``), a GGUF file's tensor
types, or the flag. For each layer it hands out a method (``get_quant_method(layer, prefix)``):

* ``LinearMethodBase`` for ``Linear`` / ``PackedLinear`` layers:

  - ``create_weights(layer, ...)`` registers the layer's checkpoint parameters (each with a
    ``weight_loader(param, tensor[, shard_id])``), replacing the float ``weight`` when the checkpoint
    stores something else;
  - ``process_weights_after_loading(layer)`` repacks what was loaded into the layout the kernel
    consumes (or quantizes a float weight, for the on-the-fly methods);
  - ``apply(layer, x, bias)`` runs ``x [..., K] -> [..., N]``;
  - ``dequantize(layer)`` gives the float weight ``[N, K]`` (tests, ``quantization="none"``).

* ``EmbeddingMethodBase`` for an ``Embedding`` whose table stays quantized (``embedding(layer, ids)``).

Model files hold no quantization code: ``pagedllm.quantization.apply`` attaches the methods to a
built model from outside, ``Linear.forward`` calls ``quant_method.apply`` when one is set (None =
the float weight, the unquantized default) and ``Embedding.forward`` calls ``embedding``.

Tensor-parallel sharding of quantized weights lives in the methods' weight loaders: every
parameter a method creates carries ``output_dim`` / ``input_dim`` (which dims of the checkpoint
tensor run along N / K, None when neither) and ``packed_dim`` / ``packed_factor`` (a dim that packs
several values per element), vLLM's attribute names, so a sharding pass can slice checkpoint
tensors before they reach the loader.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import nn


class QuantizeMethodBase:
    """Base of every per-layer method."""

    def create_weights(self, layer: nn.Module, **kwargs: Any) -> None:
        """Register the layer's checkpoint parameters (default: keep what the layer has)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into the kernel's layout (default: nothing)."""


class LinearMethodBase(QuantizeMethodBase):
    """How one linear layer stores its weight and computes ``x @ W.T + b``."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [..., K]`` (float32/bfloat16) -> ``[..., N]`` in x's dtype (unless the method fixes it)."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> Optional[torch.Tensor]:
        """The layer's weight as float32 ``[N, K]`` (None if this method cannot)."""
        return None

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, act) -> Optional[Any]:
        """For a fused gate/up layer: ``act(gate) * up`` in whatever form the next layer's method
        takes, or None to let the caller compute it from ``apply``'s output (the default)."""
        return None


class EmbeddingMethodBase(QuantizeMethodBase):
    """How an embedding table is stored and looked up."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``ids [T]`` -> ``[T, hidden]`` in the model dtype."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """The float weight (``Linear``'s own path: ``F.linear``).

    ``Linear`` runs this path itself when its ``quant_method`` is None; this class exists for code
    that wants a method object for every layer."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)

    def dequantize(self, layer):
        return layer.weight.detach().float()


class QuantizationConfig:
    """A quantization format and its options.

    Subclasses set ``name`` (the ``--quantization`` / ``quant_method`` value) and implement
    ``get_quant_method``. ``from_config`` builds one from a checkpoint's ``quantization_config``
    dict and raises ``ValueError`` naming any option it cannot run.

    Attributes:
        quantize_lm_head: whether a tied LM head gets its own quantized copy (on-the-fly methods).
        dequantize_after_load: ``quantization="none"``: load the checkpoint's format, then turn
            every quantized layer back into float weights in the model dtype.
    """

    name: ClassVar[str] = ""
    #: the float weights are quantized after loading (int8/int4/w8a8), not read quantized
    on_the_fly: ClassVar[bool] = False

    def __init__(self) -> None:
        self.quantize_lm_head = True
        self.dequantize_after_load = False

    @classmethod
    def from_config(cls, config: dict) -> "QuantizationConfig":
        """Build from a checkpoint's ``quantization_config``.

        Raises:
            ValueError: an option this engine cannot run (named in the message).
        """
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        """The method for ``layer`` (a ``Linear`` or an ``Embedding``) named ``prefix`` in the
        model (``model.layers.0.self_attn.qkv_proj``, ``lm_head``, ``model.embed_tokens``), or None
        to leave it in float."""
        raise NotImplementedError

    def tied_lm_head_method(self, model: nn.Module) -> Optional[LinearMethodBase]:
        """For tied embeddings: a method for a separate LM head (``model.logits_processor.tied_head``),
        built after loading; None = the head is the float embedding table (default)."""
        return None

    def process_model(self, model: nn.Module) -> dict:
        """Model-level work after every layer is processed (e.g. W8A8's fused norm + quantize);
        returns extra statistics for the load log."""
        return {}

    def describe(self) -> str:
        """One line for the load log."""
        return self.name


#: name -> QuantizationConfig subclass (``register_quantization_config``).
_REGISTRY: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(name: str):
    """Class decorator registering a ``QuantizationConfig`` under ``name`` (a ``quant_method`` /
    ``--quantization`` value)."""

    def deco(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"quantization method {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_quantization_config_cls(name: str) -> type[QuantizationConfig]:
    """The registered class for ``name``.

    Raises:
        ValueError: unknown name (the message lists the supported ones).
    """
    from pagedllm.quantization import registry  # noqa: F401  (registers every method)

    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"quantization method {name!r} is not supported; supported: {sorted(_REGISTRY)}")
    return cls


def registered_methods() -> list[str]:
    """Every registered method name."""
    from pagedllm.quantization import registry  # noqa: F401

    return sorted(_REGISTRY)


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> nn.Parameter:
    """Set loader attributes (``weight_loader``, ``output_dim``, ...) on ``param``; returns it."""
    for k, v in attrs.items():
        setattr(param, k, v)
    return param
