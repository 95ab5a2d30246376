"""``LoRALinear``: a wrapper plugged around a built model's projections from outside.

``wrap_lora_layers(model, max_loras)`` replaces, in every ``SelfAttention`` and ``GatedMLP`` of
``pagedllm.models.layers``, ``qkv_proj`` / ``o_proj`` / ``gate_up_proj`` / ``down_proj`` by a
``LoRALinear`` holding the original module as ``base_layer``: whatever that computes (a float
``Linear``, one prepacked for oneDNN, a weight-only int8/int4 or a W8A8 linear) is computed
unchanged, and the step's LoRA deltas are added to its output (``ops.lora_segments_``). Model
files carry no LoRA code.

The step's adapter mapping is read from the forward context (``ForwardContext.lora_mapping``, set
by the model runner for steps with adapter rows; None otherwise, and then the wrapper is just its
base layer). Each wrapper holds, per adapter slot, the ``(a, bt)`` weights of the adapter loaded
there (``LoRAModelManager`` fills them).

A quantized base (``Linear.quant_method``: weight-only int8/int4, W8A8, GGUF blocks, GPTQ, ...)
stays quantized: the wrapper's ``quant_method`` is the base's method bound to the base layer
(``_BoundQuantMethod``), so the gated MLP's fused act-and-mul (W8A8: gate/up -> quantized
``down_proj`` input) keeps working for steps without adapter rows; in steps with adapter rows it
declines (the MLP then calls the wrapper, which adds the deltas). A quantized input (a norm that
quantizes its output for the projection) is dequantized for the adapter rows.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.attention.backend import get_forward_context
from pagedllm.lora.ops import lora_segments_
from pagedllm.lora.peft_loader import LoRATarget
from pagedllm.models.layers import GatedMLP, SelfAttention


def current_lora_mapping() -> Any:
    """The running forward's ``LoRAMapping``, or None (no adapter rows, or no forward context)."""
    try:
        return get_forward_context().lora_mapping
    except (RuntimeError, AttributeError):
        return None


class _BoundQuantMethod:
    """A wrapper's view of its base layer's quantization method: every call goes to the base
    layer (the wrapper holds no quantized weights), and ``apply_act_and_mul`` declines (None)
    while the step has adapter rows, since a fused gate/up would skip the wrapper's deltas.

    Args:
        method: the base layer's ``quant_method`` (a ``pagedllm.quantization`` linear method).
        base_layer: the wrapped projection.
    """

    def __init__(self, method: Any, base_layer: nn.Module) -> None:
        self.method, self.base_layer = method, base_layer

    def apply(self, layer: nn.Module, x: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The base projection of ``x`` (``layer`` is the wrapper; no deltas here)."""
        return self.method.apply(self.base_layer, x, bias)

    def apply_act_and_mul(self, layer: nn.Module, x: Any, act: Any) -> Any:
        """The base method's fused ``act(gate) * up``, or None in steps with adapter rows."""
        if current_lora_mapping() is not None:
            return None
        return self.method.apply_act_and_mul(self.base_layer, x, act)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


class LoRALinear(nn.Module):
    """``base_layer(x)`` plus this step's LoRA deltas.

    Args:
        base_layer: the projection (any module ``[T, in] -> [T, out]``).
        target: its ``LoRATarget`` (name, sizes, fused slices).
        max_loras: adapter slots.

    Attributes:
        slot_weights: per slot, ``(a [k, in], bt [k, out])`` on the model's device, or None.
    """

    def __init__(self, base_layer: nn.Module, target: LoRATarget, max_loras: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.target = target
        self.slot_weights: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * max_loras
        qm = getattr(base_layer, "quant_method", None)
        # NOTE: one object for the wrapper's life: callers compare it by identity (the fused
        # decode plan is rebuilt when a projection's method changes)
        self._bound_quant_method = None if qm is None else _BoundQuantMethod(qm, base_layer)

    @property
    def in_features(self) -> int:
        return self.target.in_features

    @property
    def out_features(self) -> int:
        return self.target.out_features

    @property
    def quant_method(self) -> Optional[_BoundQuantMethod]:
        """The base layer's quantization method bound to it (None for a float base); its fused
        ``apply_act_and_mul`` (read by ``GatedMLP`` every forward) declines in steps with adapter
        rows."""
        return self._bound_quant_method

    def forward(self, x: Any) -> torch.Tensor:
        """x ``[T, in]`` (or a W8A8 ``QuantizedActivation``) -> ``[T, out]``."""
        out = self.base_layer(x)
        mapping = current_lora_mapping()
        if mapping is None:
            return out
        return lora_segments_(out, x, self.slot_weights, mapping.segments)

    def extra_repr(self) -> str:
        return f"target={self.target.name!r}, slots={len(self.slot_weights)}"


def _features(mod: nn.Module) -> tuple[int, int]:
    inner = getattr(mod, "base_layer", mod)
    return int(inner.in_features), int(inner.out_features)


def find_lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """The adaptable projections of ``model``: ``{module name: LoRATarget}``.

    q/k/v slices of ``qkv_proj`` come from the attention block's head counts (this rank's, after
    any sharding); gate/up are the two halves of ``gate_up_proj``.
    """
    out: dict[str, LoRATarget] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, SelfAttention):
            d = m.head_dim
            q, kv = m.num_heads * d, m.num_kv_heads * d
            i, o = _features(m.qkv_proj)
            out[prefix + "qkv_proj"] = LoRATarget(prefix + "qkv_proj", i, o,
                                                  {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)})
            i, o = _features(m.o_proj)
            out[prefix + "o_proj"] = LoRATarget(prefix + "o_proj", i, o, {None: (0, o)})
        elif isinstance(m, GatedMLP):
            i, o = _features(m.gate_up_proj)
            half = o // 2
            out[prefix + "gate_up_proj"] = LoRATarget(prefix + "gate_up_proj", i, o, {0: (0, half), 1: (half, half)})
            i, o = _features(m.down_proj)
            out[prefix + "down_proj"] = LoRATarget(prefix + "down_proj", i, o, {None: (0, o)})
    return out


def wrap_lora_layers(model: nn.Module, max_loras: int) -> dict[str, LoRALinear]:
    """Wrap every adaptable projection of ``model`` in a ``LoRALinear``, in place (after loading,
    quantization and prepacking; idempotent). Returns ``{module name: LoRALinear}``."""
    targets = find_lora_targets(model)
    wrapped: dict[str, LoRALinear] = {}
    for name, target in targets.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        mod = getattr(parent, attr)
        if not isinstance(mod, LoRALinear):
            mod = LoRALinear(mod, target, max_loras)
            setattr(parent, attr, mod)
        wrapped[name] = mod
    return wrapped
