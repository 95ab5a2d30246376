"""W8A8 int8 quantization: int8 weights and int8 activations with a dynamic scale per token (CPU).

``--quantization w8a8`` gives every linear projection (and the LM head) a ``W8A8LinearMethod``
(compressed-tensors ``int-quantized`` checkpoints load their int8 weights into the same method):

* weights: symmetric per output channel, ``w ~= q_w[N, K] * s_w[N]`` (quantized once at load);
* activations: symmetric per row (token), ``x ~= q_x[M, K] * s_x[M]``, computed every call from
  the row's own values, so a request's result never depends on what else is in the batch;
* GEMM: int8 x int8 -> int32, then ``y = acc * s_x[:, None] * s_w[None, :] (+ bias)`` in float32,
  stored in the model dtype. Up to ``PACKED_GEMM_MAX_M`` rows (decode batches) it runs
  ``int8_gemm_packed`` (``kernels/csrc/int8_gemm.cpp``, AVX512-VNNI) on the weights packed once
  at load (``pack_int8_weight``, the only copy kept); larger M (prefill chunks) unpacks them for
  ``torch._int_mm(q_x, q_w.t())`` (oneDNN). CPUs without VNNI run ``int8_gemm_nk`` (AVX2) on the
  plain ``[N, K]`` weight at every M (``torch._int_mm`` is ATen's reference loop there). All give
  the same integers.

This is the scheme of vLLM's int8 W8A8 path (per-channel weights, dynamic per-token activations)
and close to what llama.cpp does on CPU (activations quantized to Q8 for its integer dot products).
On this machine the int8 GEMM runs at ~2x the bf16 GEMM's FLOP/s, and its M=1 GEMV reads half
the bytes (docs/performance.md "W8A8").

Fusions, when the C++ kernels are available (``pagedllm.kernels.cpu_ops``; each has the torch
reference below, which is also the fallback):

* an ``RMSNorm`` whose output feeds a W8A8 projection (a decoder layer's ``norm_feeds``) is
  given the ``QuantizingNormMethod`` from outside (``W8A8Config.process_model``) that quantizes its
  output directly (``rms_norm_quant``), with the residual add folded in;
* a SiLU-gated MLP turns the gate/up accumulators into the quantized input of ``down_proj`` in
  one pass (``dequant_silu_mul_quant``, ``W8A8LinearMethod.apply_act_and_mul``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu_ops import get_ops
from pagedllm.quantization.base import LinearMethodBase, QuantizationConfig, register_quantization_config
from pagedllm.quantization.weight_only import _param, _standalone, quantize_int8
from pagedllm import envs


#: Largest number of rows run by the packed VNNI kernel; larger GEMMs run ``torch._int_mm``. The
#: kernel was 1.1-2x faster than oneDNN up to M = 256 on the 2-core AVX512-VNNI machine
#: (benchmarks/results/performance-history-2026-11.md, step 18).
#: ``PAGEDLLM_W8A8_PACKED_MAX_M=0`` turns it off (for A/B runs).
PACKED_GEMM_MAX_M = int(envs.get("PAGEDLLM_W8A8_PACKED_MAX_M"))
#: The AVX2 int8 GEMM on the plain ``[N, K]`` weight (``int8_gemm_nk``, ``kernels/csrc/int8_gemm.cpp``)
#: for every M where the packed VNNI kernel is not built; ``PAGEDLLM_W8A8_NK_GEMM=0`` runs
#: ``torch._int_mm`` instead (for A/B runs). Both give the same integers.
_NK_GEMM = bool(envs.get("PAGEDLLM_W8A8_NK_GEMM"))


class QuantizedActivation(NamedTuple):
    """Rows of an activation quantized for a ``W8A8Linear``.

    Attributes:
        q: int8 ``[M, K]``, values in -127..127.
        scale: float32 ``[M]``; row m is ``q[m] * scale[m]``.
        dtype: the float dtype the un-quantized activation had (the output dtype of the next layer).
    """

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def _ops():
    """The C++ kernels when built with the W8A8 functions, else None (``get_ops`` caches the module)."""
    ops = get_ops()
    return ops if ops is not None and hasattr(ops, "quantize_rows_int8") else None


# ----------------------------------------------------------------------------- torch references
def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float -> (int8 ``[M, K]``, float32 scales ``[M]``): symmetric, one scale per row.

    ``scale = max|x_row| / 127``, ``q = round_half_even(x * 127 / max|x_row|)``; an all-zero row
    gets scale 0 and q 0.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def dequant_ref(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: Optional[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """int32 ``acc [M, N]`` -> ``acc * (sx[:, None] * sw[None, :]) (+ bias)`` in ``dtype`` (the
    C++ kernels' order of operations)."""
    y = acc.float() * (sx[:, None] * sw[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def dequant_silu_mul_quant_ref(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate|up accumulators ``[M, 2I]`` -> quantized ``silu(gate) * up`` (``[M, I]`` int8, ``[M]``)."""
    g, u = dequant_ref(acc, sx, sw, None, torch.float32).chunk(2, dim=-1)
    return quantize_rows_ref(F.silu(g) * u)


def rms_norm_quant_ref(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(rms_norm(x [+ residual]) * weight)``; with a residual, ``residual += x`` in place."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return quantize_rows_ref(xf * weight.float())


def pack_int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack int8 weights ``w [N, K]`` for ``int8_gemm_packed``.

    Returns:
        ``packed``: int8 ``[ceil(N/16), ceil(K/4), 64]`` with
        ``packed[nb, kq, 4 * j + i] = w[16 * nb + j, 4 * kq + i]`` (zeros past N and K): each
        64-byte row is one AVX512-VNNI ``vpdpbusd`` operand for 16 output columns x 4 k.
        ``comp``: int32 ``[16 * ceil(N/16)]``, ``128 * sum_k w[n, k]`` (the kernel multiplies
        ``x + 128`` as unsigned bytes and subtracts this).

    Raises:
        ValueError: if ``w`` is not a 2-D int8 tensor.
    """
    if w.dim() != 2 or w.dtype != torch.int8:
        raise ValueError(f"pack_int8_weight: w must be a 2-D int8 tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    nb, kq = -(-n // 16), -(-k // 4)
    padded = w.contiguous()
    if (nb * 16, kq * 4) != (n, k):
        padded = torch.zeros(nb * 16, kq * 4, dtype=torch.int8)
        padded[:n, :k] = w
    # NOTE: 4 consecutive k of a row move together, so the permute runs on int32 elements
    # (~40x faster than on bytes; start-up packs every layer).
    packed = padded.view(torch.int32).view(nb, 16, kq).permute(0, 2, 1).contiguous()
    comp = torch.zeros(nb * 16, dtype=torch.int32)
    comp[:n] = w.sum(dim=1, dtype=torch.int32) * 128
    return packed.view(torch.int8).view(nb, kq, 64), comp


def unpack_int8_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 ``[n, k]`` weight that ``pack_int8_weight`` packed (a new contiguous tensor)."""
    nb, kq, _ = packed.shape
    w = packed.view(torch.int32).view(nb, kq, 16).permute(0, 2, 1).contiguous().view(torch.int8)
    w = w.view(nb * 16, kq * 4)
    return w if (nb * 16, kq * 4) == (n, k) else w[:n, :k].contiguous()


# ----------------------------------------------------------------------------- entry points
def quantize_rows(x: torch.Tensor) -> QuantizedActivation:
    """Quantize ``x [M, K]`` (float32/bfloat16) per row; the C++ kernel when built, else the reference."""
    x2 = x.contiguous()
    ops = _ops()
    q, s = ops.quantize_rows_int8(x2) if ops is not None and x2.dtype in (torch.float32, torch.bfloat16) \
        else quantize_rows_ref(x2)
    return QuantizedActivation(q, s, x.dtype)


def rms_norm_quant(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                   eps: float) -> QuantizedActivation:
    """RMSNorm (weight multiplied as given) then per-row quantization; ``residual += x`` first if given.

    Args:
        x: ``[M, K]`` float32/bfloat16. residual: ``[M, K]`` same dtype, updated in place, or None.
        weight: float32 ``[K]``, the effective multiplier (Gemma's ``1 + w`` already applied).
        eps: the norm's epsilon.
    """
    ops = _ops()
    if (ops is not None and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == torch.float32
            and x.is_contiguous() and (residual is None or residual.is_contiguous())):
        q, s = ops.rms_norm_quant(x, residual, weight, eps)
    else:
        q, s = rms_norm_quant_ref(x, residual, weight, eps)
    return QuantizedActivation(q, s, x.dtype)


def quantize_rows_static(x: torch.Tensor, scale: torch.Tensor) -> QuantizedActivation:
    """``x [M, K]`` quantized with one fixed scale (a checkpoint's static per-tensor
    ``input_scale``): ``q = clamp(round(x / scale), -127, 127)``, every row's scale = ``scale``."""
    s = scale.float().reshape(())
    q = torch.round(x.float() / s).clamp_(-127, 127).to(torch.int8)
    return QuantizedActivation(q, s.expand(x.shape[0]).contiguous(), x.dtype)


def int8_weight(layer: nn.Module) -> torch.Tensor:
    """A W8A8 layer's int8 weight ``[N, K]`` (unpacked into a new tensor when stored packed)."""
    if layer.weight_int8 is not None:
        return layer.weight_int8
    return unpack_int8_weight(layer.weight_packed, layer.out_features, layer.in_features)


def install_int8_weight(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Give ``layer`` W8A8 operands from int8 ``q [N, K]`` and float32 per-channel ``scales [N]``.

    One copy of the weights: in the VNNI kernel's layout when it is built (GEMMs of more than
    PACKED_GEMM_MAX_M rows unpack it for torch._int_mm, ~1% of such a GEMM's time), else as
    ``weight_int8 [N, K]`` for torch._int_mm. The float ``weight`` becomes an empty tensor."""
    layer.w_scales = _param(scales.float().contiguous())
    ops = _ops()
    if (PACKED_GEMM_MAX_M > 0 and ops is not None and hasattr(ops, "int8_gemm_supported")
            and ops.int8_gemm_supported() and q.device.type == "cpu"):
        packed, comp = pack_int8_weight(q)
        layer.weight_int8 = None
        layer.weight_packed = _param(packed)
        layer.weight_comp = _param(comp)
    else:
        layer.weight_int8 = _param(q)
        layer.weight_packed = layer.weight_comp = None
    w = layer.weight
    layer.weight = _param(torch.empty(0, dtype=w.dtype if w.is_floating_point() else torch.float32,
                                      device=w.device))


class W8A8LinearMethod(LinearMethodBase):
    """int8 per-channel weights and int8 activations: dynamic per-token scales (default) or one
    static per-tensor ``input_scale`` (set on the layer by a checkpoint).

    ``apply(layer, x)``: ``x`` is a float ``[..., K]`` tensor (quantized here) or a
    ``QuantizedActivation`` (already quantized by a fused producer); returns ``[..., N]`` in
    ``out_dtype``, or the activation's float dtype when that is None.

    Layer attributes after processing (``install_int8_weight``): ``weight_packed``,
    ``weight_comp`` (the packed VNNI operands, or None), ``weight_int8`` (int8 ``[N, K]`` when not
    packed, else None), ``w_scales`` float32 ``[N]``; ``input_scale`` float32 scalar (static only).

    Args:
        out_dtype: fixed output dtype (float32 for the LM head) or None.
        static: activations use the layer's ``input_scale`` instead of per-token scales.
    """

    def __init__(self, out_dtype: Optional[torch.dtype] = None, static: bool = False) -> None:
        self.out_dtype, self.static = out_dtype, static

    def process_weights_after_loading(self, layer):
        """Quantize the float ``weight`` (``--quantization w8a8``)."""
        q, s = quantize_int8(layer.weight)  # per output channel, the same weights as weight-only int8
        install_int8_weight(layer, q, s)

    def dequantize(self, layer):
        return int8_weight(layer).float() * layer.w_scales[:, None]

    def _quantize_input(self, layer, x2: torch.Tensor) -> QuantizedActivation:
        if self.static:
            return quantize_rows_static(x2, layer.input_scale)
        return quantize_rows(x2)

    def matmul_int32(self, layer, qa: QuantizedActivation) -> torch.Tensor:
        """int32 accumulators ``[M, N]`` of ``qa.q @ weight.T`` (exact integer arithmetic)."""
        ops = _ops()
        if layer.weight_packed is not None and ops is not None and qa.q.shape[0] <= PACKED_GEMM_MAX_M:
            return ops.int8_gemm_packed(qa.q.contiguous(), layer.weight_packed, layer.weight_comp,
                                        layer.out_features)
        if (layer.weight_int8 is not None and ops is not None and _NK_GEMM and qa.q.device.type == "cpu"
                and ops.int8_gemm_nk_supported()):
            # CPUs without AVX512-VNNI: torch._int_mm is ATen's reference loop there (13x slower
            # than the float32 model on a 400-token prefill on Zen 1); the same integers
            return ops.int8_gemm_nk(qa.q.contiguous(), layer.weight_int8)
        # NOTE: the transposed view of the [N, K] weight is what oneDNN runs fastest at small M.
        return torch._int_mm(qa.q, int8_weight(layer).t())

    def apply(self, layer, x, bias=None):
        if isinstance(x, QuantizedActivation):
            qa, lead = x, None
        else:
            lead = x.shape[:-1]
            qa = self._quantize_input(layer, x.reshape(-1, layer.in_features))
        ops = _ops()
        dtype = self.out_dtype or qa.dtype
        if (ops is not None and layer.weight_packed is not None and qa.q.shape[0] <= PACKED_GEMM_MAX_M
                and dtype in (torch.float32, torch.bfloat16)):
            # the packed GEMM with the dequantization as its epilogue (bit-identical to the
            # two-step path below, without the int32 [M, N] round trip)
            y = ops.int8_gemm_packed_dequant(qa.q.contiguous(), layer.weight_packed, layer.weight_comp,
                                             layer.out_features, qa.scale, layer.w_scales, bias, dtype)
            return y if lead is None else y.reshape(*lead, layer.out_features)
        acc = self.matmul_int32(layer, qa)
        if ops is not None and dtype in (torch.float32, torch.bfloat16):
            y = ops.dequant_int32(acc, qa.scale, layer.w_scales, bias, dtype)
        else:
            y = dequant_ref(acc, qa.scale, layer.w_scales, bias, dtype)
        return y if lead is None else y.reshape(*lead, layer.out_features)

    def apply_act_and_mul(self, layer, x, act):
        """For a fused gate/up projection with SiLU and no bias: quantized ``silu(gate) * up``
        ready for ``down_proj`` (one pass); None otherwise (the caller runs ``apply``)."""
        if act is not F.silu or layer.bias is not None or self.static:
            return None
        return self.forward_silu_mul_quant(layer, x)

    def forward_silu_mul_quant(self, layer, x) -> QuantizedActivation:
        """Quantized ``silu(gate) * up`` (``[M, I]`` int8 rows) from the fused gate/up layer.

        Raises:
            ValueError: if the layer has a bias (the fused kernel has none).
        """
        if layer.bias is not None:
            raise ValueError("forward_silu_mul_quant: biased gate/up projections are not fused")
        qa = x if isinstance(x, QuantizedActivation) else self._quantize_input(layer, x.reshape(-1, layer.in_features))
        acc = self.matmul_int32(layer, qa)
        ops = _ops()
        q, s = ops.dequant_silu_mul_quant(acc, qa.scale, layer.w_scales) if ops is not None \
            else dequant_silu_mul_quant_ref(acc, qa.scale, layer.w_scales)
        return QuantizedActivation(q, s, qa.dtype)


class QuantizingNormMethod:
    """An ``RMSNorm``'s ``norm_method`` whose 2-D CPU output is a ``QuantizedActivation``
    computed in one fused pass (``rms_norm_quant``), with the residual add folded in; other inputs
    take the norm's float path. ``quantize_output`` is True (read through ``RMSNorm.quantize_output``
    by ``worker.fused_decode``)."""

    quantize_output = True

    def apply(self, norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if (x.dim() == 2 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))):
            out = rms_norm_quant(x.contiguous(), residual, norm._effective_weight(), norm.eps)
            return out if residual is None else (out, residual)
        return norm.forward_native(x, residual)


_QUANTIZING_NORM = QuantizingNormMethod()


def fuse_norms(model: nn.Module) -> int:
    """W8A8: let each norm that directly feeds a dynamic W8A8 projection emit quantized rows.

    Decoder layers declare ``norm_feeds = {norm name: projection path}`` (structure only); the
    norm gets the ``QuantizingNormMethod`` (same parameters). Returns how many norms were given it."""
    n = 0
    for layer in model.modules():
        for norm_name, proj_path in getattr(type(layer), "norm_feeds", {}).items():
            norm = getattr(layer, norm_name, None)
            proj = layer.get_submodule(proj_path)
            qm = getattr(proj, "quant_method", None)
            if (norm is not None and hasattr(norm, "norm_method") and isinstance(qm, W8A8LinearMethod)
                    and not qm.static and norm.norm_method is None):
                norm.norm_method = _QUANTIZING_NORM
                n += 1
    return n


@register_quantization_config("w8a8")
class W8A8Config(QuantizationConfig):
    """``--quantization w8a8``: int8 per-channel weights, dynamic per-token int8 activations,
    every linear and the LM head (float32 logits)."""

    on_the_fly = True

    @classmethod
    def from_config(cls, config):
        raise ValueError("'w8a8' quantizes float weights at load (--quantization w8a8); it is not a checkpoint "
                         "format (W8A8 checkpoints are 'compressed-tensors')")

    def get_quant_method(self, layer, prefix):
        if not isinstance(layer, nn.Linear):
            return None
        if prefix == "lm_head":
            return W8A8LinearMethod(out_dtype=torch.float32) if self.quantize_lm_head else None
        return W8A8LinearMethod()

    def tied_lm_head_method(self, model):
        return W8A8LinearMethod(out_dtype=torch.float32) if self.quantize_lm_head else None

    def process_model(self, model):
        return {"fused_norms": fuse_norms(model)}


def W8A8Linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A ``Linear`` with ``weight [N, K]`` quantized by ``W8A8LinearMethod(out_dtype)``."""
    return _standalone(weight, bias, W8A8LinearMethod(out_dtype))
