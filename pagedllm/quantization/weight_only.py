"""Weight-only int8 / int4 quantization of a loaded model's float weights (``--quantization int8|int4``, CPU).

``Int8Config`` / ``Int4Config`` hand every ``Linear`` (``PackedLinear``, ``QKVLinear``, an untied
``lm_head``) an ``Int8LinearMethod`` / ``Int4LinearMethod``: the checkpoint's float weight loads as
usual and ``process_weights_after_loading`` quantizes it, replacing ``weight`` by the packed
tensors below. The LM head is quantized too; for tied embeddings a separate quantized head
(``model.logits_processor.tied_head``) is added and the embedding table stays in the model dtype for lookups.

Kernels (torch CPU, see docs/hardware-and-models.md "Which torch ops are fast or slow" and
docs/performance.md "Low-bit weights"):

* int8: per-output-channel symmetric, ``aten._weight_int8pack_mm(x, w[N, K] int8, scales[N])``.
* int4: group-wise (``group_size`` along K, default 32) asymmetric,
  ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 (the op's convention, checked empirically),
  ``aten._convert_weight_to_int4pack_for_cpu`` + ``aten._weight_int4pack_mm_for_cpu``.

Both kernels only pay off at small M and with bf16 activations, so activations are cast to
bfloat16 for the kernel (and the output back to the input dtype), and for ``M > large_m`` rows the
weight is dequantized on the fly to bf16 and a plain bf16 ``F.linear`` is used (no resident float
copy of the weight); on CPUs without native bf16, float32 activations of ``M > large_m`` rows run
a float32 ``F.linear`` on the weight dequantized to float32 instead (torch emulates bf16 GEMMs
there at ~1 GFLOP/s).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms import cpu_has_native_bf16
from pagedllm.quantization.base import LinearMethodBase, QuantizationConfig, register_quantization_config

logger = logging.getLogger("pagedllm")

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


#: row blocks of ``_convert_weight_to_int4pack_for_cpu``'s layout: torch 2.x packs 64-row blocks on
#: AVX-512 CPUs and 32-row blocks on AVX2-only ones (measured with torch 2.13 on Zen 1)
_INT4_PACK_BLOCKS = (64, 32)


def _unpack_int4_cpu(packed: torch.Tensor, n: int, k: int, block: int = 64) -> Optional[torch.Tensor]:
    """Inverse of ``_convert_weight_to_int4pack_for_cpu`` for ``N % block == 0`` (the layout torch
    2.x uses: blocks of ``block`` rows stored ``[K, block / 2]`` bytes, low nibble = row j, high =
    row j + block / 2). Returns uint8 ``q [N, K]`` or None for other N or another packed size
    (the caller checks the result against the source)."""
    if n % block or packed.numel() != n * k // 2:
        return None
    p = packed.reshape(n // block, k, block // 2)
    q = torch.cat((p & 0xF, p >> 4), dim=-1)  # [N/block, K, block]
    return q.transpose(1, 2).reshape(n, k)


def _empty_weight(layer: nn.Module) -> None:
    """Drop the float weight (an empty tensor keeps ``layer.weight.dtype`` / ``.device`` readable)."""
    w = layer.weight
    layer.weight = _param(torch.empty(0, dtype=w.dtype, device=w.device))


class _WeightOnlyMethod(LinearMethodBase):
    """Common ``apply``: bf16 kernel for ``M <= large_m`` rows, dequantize + bf16 matmul above."""

    large_m: int = DEFAULT_LARGE_M

    def _kernel(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize_bf16(self, layer: nn.Module) -> Optional[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> Optional[torch.Tensor]:
        w = self.dequantize_bf16(layer)
        return None if w is None else w.float()

    def dequantize_f32(self, layer: nn.Module) -> Optional[torch.Tensor]:
        """float32 ``[N, K]`` for the large-M path on CPUs without native bf16 (default: ``dequantize``)."""
        return self.dequantize(layer)

    def apply(self, layer, x, bias=None):
        shape = x.shape
        x2 = x.reshape(-1, layer.in_features)
        if x2.shape[0] > self.large_m and x2.dtype == torch.float32 and x2.device.type == "cpu" \
                and not cpu_has_native_bf16():
            # float32 activations on a CPU without native bf16 (dtype auto there): a float32 GEMM on
            # the dequantized weight; torch's emulated bf16 GEMM runs at ~1 GFLOP/s on such CPUs
            # (a 400-token int8 prefill of SmolLM2 took 15 s on Zen 1, the float32 model 3.6 s)
            w = self.dequantize_f32(layer)
            if w is not None:
                y = F.linear(x2, w, bias)
                return y.reshape(*shape[:-1], layer.out_features)
        xc = x2 if x2.dtype == _CT else x2.to(_CT)
        w = self.dequantize_bf16(layer) if x2.shape[0] > self.large_m else None
        y = F.linear(xc, w) if w is not None else self._kernel(layer, xc.contiguous())
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y.add_(bias)  # NOTE: in place keeps the activation dtype
        return y.reshape(*shape[:-1], layer.out_features)


class Int8LinearMethod(_WeightOnlyMethod):
    """Per-output-channel symmetric int8 weights: the layer gets ``weight_int8 [N, K]`` int8 and
    ``scales [N]`` bf16 (``aten._weight_int8pack_mm``)."""

    def process_weights_after_loading(self, layer):
        q, s = quantize_int8(layer.weight)
        layer.weight_int8 = _param(q)
        layer.scales = _param(s.to(_CT))
        _empty_weight(layer)

    def _kernel(self, layer, x):
        return torch.ops.aten._weight_int8pack_mm(x, layer.weight_int8, layer.scales)

    def dequantize_bf16(self, layer) -> torch.Tensor:
        """bf16 ``[N, K]``."""
        return layer.weight_int8 * layer.scales[:, None]

    def dequantize_f32(self, layer) -> torch.Tensor:
        """float32 ``[N, K]``: ``q * scale`` (exact in float32)."""
        return layer.weight_int8.float() * layer.scales.float()[:, None]


class Int4LinearMethod(_WeightOnlyMethod):
    """Group-wise asymmetric int4 weights packed for ``_weight_int4pack_mm_for_cpu``.

    The layer gets ``weight_int4pack [N, K/2] uint8`` (torch's CPU layout) and
    ``scales_and_zeros [K/gs, N, 2]`` bf16. Dequantize + bf16 matmul only above ``INT4_LARGE_M``
    rows (unpacking is costly).

    Raises:
        ValueError: (when processing) K not divisible by ``group_size`` or N not divisible by 16
            (kernel limits).
    """

    large_m = INT4_LARGE_M

    def __init__(self, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> None:
        self.group_size = group_size

    def process_weights_after_loading(self, layer):
        n, k = layer.weight.shape
        gs = self.group_size
        if k % gs or n % 16:
            raise ValueError(f"int4: weight [{n}, {k}] needs K % group_size ({gs}) == 0 and N % 16 == 0")
        q, scales, zeros = quantize_int4(layer.weight, gs)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        layer.weight_int4pack = _param(packed)
        layer.scales_and_zeros = _param(torch.stack((scales.t(), zeros.t()), dim=-1).to(_CT).contiguous())
        # NOTE: the dequantize path is enabled only if our unpacking reproduces q exactly.
        layer._int4_block = next((b for b in _INT4_PACK_BLOCKS
                                  if (u := _unpack_int4_cpu(packed, n, k, b)) is not None
                                  and bool(torch.equal(u.to(torch.int32), q))), None)
        layer._int4_can_dequantize = layer._int4_block is not None
        _empty_weight(layer)

    def _kernel(self, layer, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.weight_int4pack, self.group_size,
                                                         layer.scales_and_zeros)

    def dequantize_bf16(self, layer) -> Optional[torch.Tensor]:
        """bf16 ``[N, K]`` (None if this packing layout is not understood: kernel only)."""
        if not layer._int4_can_dequantize:
            return None
        n, k, gs = layer.out_features, layer.in_features, self.group_size
        q = _unpack_int4_cpu(layer.weight_int4pack, n, k, layer._int4_block).reshape(n, k // gs, gs)
        sz = layer.scales_and_zeros.transpose(0, 1)  # [N, K/gs, 2]
        w = (q.to(_CT) - 8) * sz[..., :1] + sz[..., 1:]
        return w.reshape(n, k)


class _OnTheFlyConfig(QuantizationConfig):
    """Float checkpoints quantized after loading: every linear (and the LM head) gets one method."""

    on_the_fly = True

    @classmethod
    def from_config(cls, config: dict) -> "QuantizationConfig":
        raise ValueError(f"{cls.name!r} quantizes float weights at load (--quantization {cls.name}); "
                         f"it is not a checkpoint format")

    def make_method(self, head: bool) -> LinearMethodBase:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_quant_method(self, layer, prefix):
        if not isinstance(layer, nn.Linear):
            return None  # embeddings stay float (lookups)
        head = prefix == "lm_head"
        if head and not self.quantize_lm_head:
            return None
        return self.make_method(head)

    def tied_lm_head_method(self, model):
        return self.make_method(True) if self.quantize_lm_head else None


@register_quantization_config("int8")
class Int8Config(_OnTheFlyConfig):
    """``--quantization int8``: weight-only int8, per output channel."""

    def make_method(self, head):
        return Int8LinearMethod()


@register_quantization_config("int4")
class Int4Config(_OnTheFlyConfig):
    """``--quantization int4``: weight-only int4, groups of ``group_size`` (32) along K."""

    def __init__(self, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> None:
        super().__init__()
        self.group_size = group_size

    def make_method(self, head):
        return Int4LinearMethod(self.group_size)


def _standalone(weight: torch.Tensor, bias: Optional[torch.Tensor], method: LinearMethodBase) -> nn.Module:
    """A ``Linear`` holding ``weight [N, K]`` (and ``bias``) processed by ``method`` (tests, tools)."""
    from pagedllm.models.layers import Linear

    n, k = weight.shape
    lin = Linear(k, n, bias=bias is not None, device="meta")
    lin.weight = _param(weight.detach())
    if bias is not None:
        lin.bias = _param(bias.detach().clone())
    lin.quant_method = method
    with torch.no_grad():
        method.process_weights_after_loading(lin)
    return lin


def WeightOnlyInt8Linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> nn.Module:
    """A ``Linear`` with ``weight [N, K]`` quantized by ``Int8LinearMethod``."""
    return _standalone(weight, bias, Int8LinearMethod())


def WeightOnlyInt4Linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         group_size: int = DEFAULT_INT4_GROUP_SIZE) -> nn.Module:
    """A ``Linear`` with ``weight [N, K]`` quantized by ``Int4LinearMethod(group_size)``."""
    return _standalone(weight, bias, Int4LinearMethod(group_size))
