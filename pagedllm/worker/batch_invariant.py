"""Batch-invariant mode for a loaded model: swap its M-dependent operators for fixed-order ones.

``enable_batch_invariant(model)`` (called by the worker after loading, in place of oneDNN
prepacking) changes, on this model instance only:

* every ``Linear`` (``PackedLinear``, ``QKVLinear``, an untied ``lm_head``) to run
  ``kernels.batch_invariant.bi_linear``: a row's result no longer depends on how many rows the
  step has (oneDNN/MKL choose kernels by M: on AVX2 the one-row product differs in the last bits
  from the same row of a 4-row product);
* the tied LM head (``LogitsProcessor.quant_method``) likewise;
* every ``GatedMLP``'s ``act(gate) * up`` to the row-wise C++ ``act_mul`` (torch's vectorized
  SiLU/GELU body and its scalar tail round differently, and which elements fall in the tail
  depends on the step's size and thread split);
* every ``RMSNorm`` of a 3-D input (per-head q/k norms) to the row-wise C++ norm;
* (the fused C++ decode step, ``worker/fused_decode.py``, is not built in this mode: it uses
  oneDNN's linears).

Attention is swapped by the worker (``attention.batch_invariant``). Norms of 2-D inputs, rope,
the residual adds, embeddings and greedy sampling are row-wise already.

Nothing is subclassed or rebound: each module gets a method object through its one hook
(``Linear.quant_method``, ``GatedMLP.act_method``, ``RMSNorm.norm_method``), so weight loaders and
attributes stay where they were; a tied LM head's table runs the invariant GEMM as
``logits_processor.quant_method``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.kernels.batch_invariant import ACT_KINDS, batch_invariant_from_env, bi_linear, get_bi_ops
from pagedllm.models.layers import ACTIVATIONS, GatedMLP, Linear, RMSNorm
from pagedllm.quantization.base import LinearMethodBase


def batch_invariant_requested(args) -> bool:
    """Whether ``EngineArgs.batch_invariant`` or the environment (``PAGEDLLM_BATCH_INVARIANT`` /
    ``VLLM_BATCH_INVARIANT``) asks for batch-invariant mode."""
    return bool(getattr(args, "batch_invariant", False)) or batch_invariant_from_env()


def check_batch_invariant_supported(args, device: torch.device, dtype: torch.dtype,
                                    kv_cache_dtype: torch.dtype) -> None:
    """Refuse settings batch-invariant mode does not cover, naming the field.

    Raises:
        ValueError: a non-CPU device, a dtype other than float32/bfloat16, an fp8 KV cache,
            quantization, several ranks (tensor/pipeline parallel), or LoRA.
    """
    where = "batch_invariant (or PAGEDLLM_BATCH_INVARIANT / VLLM_BATCH_INVARIANT)"
    if device.type != "cpu":
        raise ValueError(f"{where}: only the CPU kernels are batch-invariant; device is {device}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{where}: dtype must be float32 or bfloat16, got {str(dtype).replace('torch.', '')}")
    if kv_cache_dtype != dtype:
        raise ValueError(f"{where}: kv_cache_dtype must be 'auto' (the model dtype), got "
                         f"{str(kv_cache_dtype).replace('torch.', '')}")
    if getattr(args, "quantization", None) not in (None, "none"):
        # NOTE: a quantized checkpoint without --quantization is dequantized at load (Worker.load_model)
        raise ValueError(f"{where}: quantization {args.quantization!r} is not supported (unquantized weights only)")
    if getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1) != 1:
        raise ValueError(f"{where}: tensor_parallel_size and pipeline_parallel_size must be 1")
    if getattr(args, "enable_lora", False):
        # NOTE: the LoRA deltas are plain GEMMs over each adapter's rows (pagedllm.lora.ops)
        raise ValueError(f"{where}: LoRA adapters (enable_lora) are not supported")


class BatchInvariantLinearMethod(LinearMethodBase):
    """A float ``Linear``'s ``quant_method`` running ``bi_linear``: ``x [..., K] -> [..., N]``
    whose rows do not depend on M (weight and bias in x's dtype)."""

    def apply(self, layer, x, bias=None):
        return bi_linear(x, layer.weight, bias)

    def dequantize(self, layer):
        return layer.weight.detach().float()


class BatchInvariantActMul:
    """A ``GatedMLP``'s ``act_method``: ``act(gate) * up`` row-wise in float32 (C++ ``act_mul``)."""

    def __init__(self, kind: int) -> None:
        self.kind = kind

    def apply(self, mlp: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [T, 2I]`` -> ``[T, I]``."""
        return get_bi_ops().act_mul(gate_up, self.kind)


class BatchInvariantNormMethod:
    """An ``RMSNorm``'s ``norm_method``: a 3-D input without residual (q/k norms ``[T, H, D]``) is
    normalized as ``[T * H, D]`` rows by the row-wise 2-D path; the rest as ``forward_native``."""

    def apply(self, norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None and x.dim() > 2:
            return norm.forward_native(x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape)
        return norm.forward_native(x, residual)


def intdot_available() -> bool:
    """Whether GGUF int4 / int8 group-32 layers run the integer-dot GEMM (on: ``PAGEDLLM_GGUF_INTDOT``
    not 0, and the kernel built) -- batch invariant by construction (each row's fixed integer
    and float operations do not depend on M or on the other rows; ``kernels/csrc/intdot_gemm.cpp``)."""
    from pagedllm.kernels.cpu_ops import get_intdot_ops
    from pagedllm.quantization import group_quant as gq

    return gq.INTDOT and get_intdot_ops() is not None


def _intdot_layer(m: nn.Module) -> bool:
    """A quantized linear whose every call takes the integer-dot GEMM (GGUF int4 / int8, groups of 32)."""
    from pagedllm.quantization import group_quant as gq

    qm = getattr(m, "quant_method", None)
    return (qm is not None and getattr(qm, "intdot", False) and getattr(m, "gq_kind", None) in (gq.KIND_INT4, gq.KIND_INT8)
            and getattr(m, "gq_group", 0) % 32 == 0 and m.in_features % 32 == 0 and intdot_available())


def _dequantize_layer(m: nn.Module, dtype: torch.dtype) -> None:
    """Replace a group-layout linear's codes by its dequantized float weight (``dtype``), in place."""
    from pagedllm.quantization import group_quant as gq

    w = gq.layer_dequantize(m).to(dtype)
    for name in ("qweight", "scales", "mins", "scales_il"):
        if hasattr(m, name):
            delattr(m, name)
    m.quant_method = None
    m.weight = nn.Parameter(w, requires_grad=False)


def enable_batch_invariant(model: nn.Module) -> int:
    """Switch ``model`` (a loaded, unquantized, unpacked CPU ``CausalLM``) to batch-invariant
    operators, in place (see the module docstring).

    Returns:
        how many modules were swapped.

    Raises:
        ValueError: a linear that is not a float ``Linear`` (quantized, oneDNN-packed), or weights
            that are not float32/bfloat16 on the CPU.
        RuntimeError: the batch-invariant kernels cannot be built.
    """
    get_bi_ops()  # NOTE: build (or fail) now, at start-up, not in the first step
    kinds = {id(fn): ACT_KINDS[name] for name, fn in ACTIVATIONS.items() if name in ACT_KINDS}
    swapped = 0
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    lp = getattr(model, "logits_processor", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    linear_method, norm_method = BatchInvariantLinearMethod(), BatchInvariantNormMethod()
    if lp is not None and lp.tied_head is None and getattr(model, "lm_head", "absent") is None and embed is not None:
        if lp.quant_method is not None:
            raise ValueError("batch_invariant: the tied LM head has a method already (oneDNN-packed?)")
        lp.quant_method = linear_method  # NOTE: the tied table through the invariant GEMM
    for name, m in list(model.named_modules()):
        if isinstance(m, Linear) and m.quant_method is not None and hasattr(m, "gq_kind"):
            if _intdot_layer(m):  # GGUF blocks on the integer-dot GEMM: invariant as they are
                swapped += 1
                continue
            _dequantize_layer(m, dtype)  # other block types (group 16: Q6_K, ...): float weights
        if isinstance(m, Linear):
            if m.quant_method is not None or m.weight.dtype not in (torch.float32, torch.bfloat16) \
                    or m.weight.device.type != "cpu":
                raise ValueError(f"batch_invariant: linear {name!r} is not a float32/bfloat16 CPU weight "
                                 f"(packed or on another device)")
            m.quant_method = linear_method
            swapped += 1
        elif isinstance(m, GatedMLP):
            kind = kinds.get(id(m.act))
            if kind is None:
                raise ValueError(f"batch_invariant: activation of {name!r} has no batch-invariant kernel "
                                 f"(supported: {sorted(ACT_KINDS)})")
            m.act_method = BatchInvariantActMul(kind)
            swapped += 1
        elif isinstance(m, RMSNorm):
            m.norm_method = norm_method
            swapped += 1
        elif type(m).__name__.endswith("Linear") and not isinstance(m, Linear) and any(
                isinstance(p, nn.Parameter) for p in m.parameters(recurse=False)):
            raise ValueError(f"batch_invariant: {name!r} ({type(m).__name__}) has no batch-invariant GEMM; "
                             f"batch_invariant needs unquantized float weights")
    model.batch_invariant = True
    return swapped
