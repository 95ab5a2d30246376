"""Weight-only int8 / int4 (and the W8A8 entry point) quantization of a built model's linear layers (gpt-fast style, CPU).

``quantize_model(model, "int8" | "int4")`` walks the model after ``load_weights`` and swaps every
``nn.Linear`` (``Linear``, ``PackedLinear``, ``QKVLinear``, an untied ``lm_head``) for a
``WeightOnlyInt8Linear`` / ``WeightOnlyInt4Linear`` with the same ``forward(x [..., K]) -> [..., N]``.
The LM head is quantized too; for tied embeddings a separate quantized head is added and the
embedding table stays in the model dtype for lookups.

Kernels (torch CPU, see FACTS.md §5 and docs/performance.md "Low-bit weights"):

* int8: per-output-channel symmetric, ``aten._weight_int8pack_mm(x, w[N, K] int8, scales[N])``.
* int4: group-wise (``group_size`` along K, default 32) asymmetric,
  ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 (the op's convention, checked empirically),
  ``aten._convert_weight_to_int4pack_for_cpu`` + ``aten._weight_int4pack_mm_for_cpu``.

Both kernels only pay off at small M and with bf16 activations, so activations are cast to
bfloat16 for the kernel (and the output back to the input dtype), and for ``M > large_m`` rows the
weight is dequantized on the fly to bf16 and a plain bf16 ``F.linear`` is used (no resident float
copy of the weight).
"""
from __future__ import annotations

import logging
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("pagedllm")

QUANTIZATION_METHODS = ("int8", "int4", "w8a8")
DEFAULT_INT4_GROUP_SIZE = 32
# Above this many rows the packed kernels lose to dequantize + bf16 matmul (measured, see docs):
# int8 dequantizes cheaply (one pass), int4 unpacking costs ~5x more, so its crossover is higher.
DEFAULT_LARGE_M = 32
INT4_LARGE_M = 256

_CT = torch.bfloat16  # compute dtype of the kernels


def _param(t: torch.Tensor) -> nn.Parameter:
    # NOTE: parameters (not buffers) so ``model.parameters()`` counts the quantized bytes.
    return nn.Parameter(t, requires_grad=False)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` float -> (int8 ``[N, K]``, float32 scales ``[N]``), ``w ~= q * scale``."""
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (q int32 ``[N, K]`` in 0..15, scales ``[N, K/gs]``, zeros ``[N, K/gs]``).

    Asymmetric min/max per group; ``w ~= (q - 8) * scale + zero`` (``zero = min + 8 * scale``).
    """
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group_size, group_size)
    mn, mx = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((mx - mn) / 15.0).clamp(min=1e-10)
    q = torch.round((g - mn[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.int32).reshape(n, k)
    return q, scales, mn + 8.0 * scales


def _unpack_int4_cpu(packed: torch.Tensor, n: int, k: int) -> Optional[torch.Tensor]:
    """Inverse of ``_convert_weight_to_int4pack_for_cpu`` for ``N % 64 == 0`` (the layout torch
    2.x uses: blocks of 64 rows stored ``[K, 32]`` bytes, low nibble = row j, high = row j + 32).
    Returns uint8 ``q [N, K]`` or None for other N (caller checks the result against the source)."""
    if n % 64:
        return None
    p = packed.reshape(n // 64, k, 32)
    q = torch.cat((p & 0xF, p >> 4), dim=-1)  # [N/64, K, 64]
    return q.transpose(1, 2).reshape(n, k)


class _WeightOnlyLinear(nn.Module):
    """Common forward: bf16 kernel for ``M <= large_m`` rows, dequantize + bf16 matmul above."""

    large_m: int = DEFAULT_LARGE_M

    def __init__(self, in_features: int, out_features: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else _param(bias.detach().clone())

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize(self) -> Optional[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        xc = x2 if x2.dtype == _CT else x2.to(_CT)
        w = self.dequantize() if x2.shape[0] > self.large_m else None
        y = F.linear(xc, w) if w is not None else self._kernel(xc.contiguous())
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y.add_(self.bias)  # NOTE: in place keeps the activation dtype
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class WeightOnlyInt8Linear(_WeightOnlyLinear):
    """Per-output-channel symmetric int8 weights; ``weight_int8 [N, K]``, ``scales [N]`` (bf16)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        n, k = weight.shape
        super().__init__(k, n, bias)
        q, s = quantize_int8(weight)
        self.weight_int8 = _param(q)
        self.scales = _param(s.to(_CT))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)

    def dequantize(self) -> torch.Tensor:
        """bf16 ``[N, K]``."""
        return self.weight_int8 * self.scales[:, None]


class WeightOnlyInt4Linear(_WeightOnlyLinear):
    """Group-wise asymmetric int4 weights packed for ``_weight_int4pack_mm_for_cpu``.

    ``weight_int4pack [N, K/2] uint8`` (torch's CPU layout), ``scales_and_zeros [K/gs, N, 2]`` bf16.
    Dequantize + bf16 matmul only above ``INT4_LARGE_M`` rows (unpacking is costly).

    Raises:
        ValueError: K not divisible by ``group_size`` or N not divisible by 16 (kernel limits).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 group_size: int = DEFAULT_INT4_GROUP_SIZE) -> None:
        n, k = weight.shape
        if k % group_size or n % 16:
            raise ValueError(f"int4: weight [{n}, {k}] needs K % group_size ({group_size}) == 0 and N % 16 == 0")
        super().__init__(k, n, bias)
        self.large_m = INT4_LARGE_M
        self.group_size = group_size
        q, scales, zeros = quantize_int4(weight, group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.weight_int4pack = _param(packed)
        self.scales_and_zeros = _param(torch.stack((scales.t(), zeros.t()), dim=-1).to(_CT).contiguous())
        unpacked = _unpack_int4_cpu(packed, n, k)
        # NOTE: the dequantize path is enabled only if our unpacking reproduces q exactly.
        self._can_dequantize = unpacked is not None and bool(torch.equal(unpacked.to(torch.int32), q))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_int4pack, self.group_size,
                                                         self.scales_and_zeros)

    def dequantize(self) -> Optional[torch.Tensor]:
        """bf16 ``[N, K]`` (None if this packing layout is not understood: kernel only)."""
        if not self._can_dequantize:
            return None
        n, k, gs = self.out_features, self.in_features, self.group_size
        q = _unpack_int4_cpu(self.weight_int4pack, n, k).reshape(n, k // gs, gs)
        sz = self.scales_and_zeros.transpose(0, 1)  # [N, K/gs, 2]
        w = (q.to(_CT) - 8) * sz[..., :1] + sz[..., 1:]
        return w.reshape(n, k)


def _make(method: str, weight: torch.Tensor, bias: Optional[torch.Tensor], group_size: int,
          head: bool = False) -> nn.Module:
    if method == "int8":
        return WeightOnlyInt8Linear(weight, bias)
    if method == "w8a8":
        from pagedllm.quantization.w8a8 import W8A8Linear

        return W8A8Linear(weight, bias, out_dtype=torch.float32 if head else None)
    return WeightOnlyInt4Linear(weight, bias, group_size)


def _fuse_norms(model: nn.Module) -> int:
    """W8A8: let each norm that directly feeds a ``W8A8Linear`` emit quantized rows (one pass).

    Decoder layers declare ``norm_feeds = {norm name: projection path}``; returns how many norms
    were switched.
    """
    from pagedllm.quantization.w8a8 import W8A8Linear

    n = 0
    for layer in model.modules():
        for norm_name, proj_path in getattr(type(layer), "norm_feeds", {}).items():
            norm = getattr(layer, norm_name, None)
            proj = layer.get_submodule(proj_path)
            if norm is not None and hasattr(norm, "quantize_output") and isinstance(proj, W8A8Linear):
                norm.quantize_output = True
                n += 1
    return n


def _quantized_compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    """``CausalLM.compute_logits`` with the quantized head (bound onto the model instance)."""
    logits = self.quantized_lm_head(hidden).float()
    cap = getattr(self.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_INT4_GROUP_SIZE,
                   quantize_lm_head: bool = True) -> dict:
    """Swap every ``nn.Linear`` under ``model`` for a weight-only quantized module, in place.

    Args:
        model: a loaded ``CausalLM`` (on CPU).
        method: "int8" or "int4".
        group_size: int4 group size along K (must divide every K; 32 or 64 for SmolLM2).
        quantize_lm_head: also quantize the LM head (``compute_logits`` is rebound on the
            instance to use ``model.quantized_lm_head``; a tied embedding stays as is for lookups).

    Returns:
        ``{"method", "num_linears", "float_bytes", "quantized_bytes"}`` of the swapped layers.

    Raises:
        ValueError: unknown method, a non-CPU model, or a shape the int4 kernel cannot take.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: must be one of {list(QUANTIZATION_METHODS)}, got {method!r}")
    dev = next(model.parameters()).device
    if dev.type != "cpu":
        raise ValueError(f"quantization {method!r}: only CPU weight-only kernels are implemented (model on {dev})")
    stats = {"method": method, "num_linears": 0, "float_bytes": 0, "quantized_bytes": 0}

    def nbytes(m: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    head = getattr(model, "lm_head", None)
    with torch.no_grad():
        for name, mod in targets:
            if mod is head:
                continue
            qmod = _make(method, mod.weight, mod.bias, group_size)
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            stats["float_bytes"] += nbytes(mod)
            stats["quantized_bytes"] += nbytes(qmod)
            setattr(parent, attr, qmod)
            stats["num_linears"] += 1
        if quantize_lm_head and hasattr(model, "compute_logits") and hasattr(model, "model"):
            if head is not None:
                w, b = head.weight, head.bias
            else:
                w, b = model.model.embed_tokens.weight, None
            qhead = _make(method, w, b, group_size, head=True)
            stats["float_bytes"] += w.numel() * w.element_size()
            stats["quantized_bytes"] += nbytes(qhead)
            model.quantized_lm_head = qhead
            if head is not None:
                model.lm_head = None  # NOTE: frees the float head; compute_logits below no longer reads it
            model.compute_logits = types.MethodType(_quantized_compute_logits, model)
            stats["num_linears"] += 1
        if method == "w8a8":
            stats["fused_norms"] = _fuse_norms(model)
    return stats
