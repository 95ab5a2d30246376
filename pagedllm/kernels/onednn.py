"""oneDNN-packed float linears on CPU, as a linear method (``OneDNNPackedLinearMethod``).

``prepack_cpu_linears(model)`` (the model build's ``select_kernels`` step) moves every unquantized
bf16 ``Linear`` -- and float32 one where :func:`float32_packing_wanted` -- to oneDNN's blocked weight
layout (``mkldnn._reorder_linear_weight``) and gives it this method. bf16: ``mkldnn._linear_pointwise``
is bit-identical to ``F.linear`` and 20-40% faster at decode batch sizes. float32: ``F.linear`` runs
MKL's sgemm, which packs the weight again on every call (~14% of a float32 offline run in
``mkl_blas_def_sgemm_scopy_right16_bdz``); the packed oneDNN GEMM is 1.2-2x faster on Zen 4 for
SmolLM2's shapes at M = 16-256 (M = 1: 0.82-2.05x by shape, 1.28x over a decoder layer) and
differs from it by float32 rounding only (~1e-6 relative; docs/performance.md). The packed weight
is the layer's ``onednn_weight`` attribute (a plain tensor: not in ``parameters()``; sleep mode
backs it up by attribute); the dense ``weight`` is dropped, except for a tied LM head, whose dense
table is the embedding's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.quantization.base import LinearMethodBase


def pack_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN-blocked copy of a bf16 or float32 CPU weight ``[N, K]`` for ``mkldnn._linear_pointwise``
    (same dtype), or None where this torch build or CPU cannot (no mkldnn, other dtype or device;
    bf16 needs avx512bw/vl/dq or avx_ne_convert)."""
    if w.dtype not in (torch.bfloat16, torch.float32) or w.device.type != "cpu" \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 64)
    except (RuntimeError, AttributeError):
        return None


def pack_bf16_weight(w: torch.Tensor) -> Optional[torch.Tensor]:
    """:func:`pack_weight` for a bf16 weight; None for any other dtype."""
    return pack_weight(w) if w.dtype == torch.bfloat16 else None


#: float32 models are packed only when every unquantized float32 linear has at least this many
#: weight elements (512 x 512): oneDNN builds a primitive for each new row count M (~0.7 ms each,
#: cached) and costs ~3x F.linear per call on tiny weights (64 x 64: ~20 vs ~6.5 us), which small
#: models (and the test suite's) would pay without gaining; all or none, so that the fused decode
#: step, which needs one kind, still runs.
FLOAT32_PACK_MIN_ELEMENTS = 1 << 18


def float32_packing_wanted() -> bool:
    """Whether float32 linears on CPU are packed for oneDNN: ``PAGEDLLM_ONEDNN_FLOAT32`` (``auto``:
    on CPUs where torch dispatches AVX-512, the kind it was measured faster on; ``1`` / ``0``
    force it)."""
    from pagedllm import envs
    mode = envs.get("PAGEDLLM_ONEDNN_FLOAT32")
    if mode != "auto":
        return mode == "1"
    try:
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    except (AttributeError, RuntimeError):
        return False


class OneDNNPackedLinearMethod(LinearMethodBase):
    """A bf16 or float32 CPU linear whose weight is oneDNN-blocked (``layer.onednn_weight``).

    ``apply``: a CPU input of the packed weight's dtype -> ``mkldnn._linear_pointwise``; any other
    input -> ``F.linear`` on the dense ``weight`` (kept only for a tied head; empty otherwise)."""

    def apply(self, layer, x, bias=None):
        p = layer.onednn_weight
        if x.dtype == p.dtype and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, p, bias, "none", [None], "")
        return F.linear(x, layer.weight, bias)

    def dequantize(self, layer):
        return layer.onednn_weight.to_dense().float()


def prepack_cpu_linears(model: nn.Module, pack_head: bool = True, float32: Optional[bool] = None) -> int:
    """Give every unquantized bf16 ``Linear`` of ``model`` (and float32 one when ``float32``, default:
    :func:`float32_packing_wanted` and every such linear at least ``FLOAT32_PACK_MIN_ELEMENTS``)
    the ``OneDNNPackedLinearMethod`` (its dense weight dropped);
    with ``pack_head``, a tied, unquantized LM head of those dtypes gets a packed copy of the
    embedding table (``embed_tokens.onednn_weight``, run by ``model.logits_processor.quant_method``;
    the table stays dense for lookups).

    Returns:
        bytes held in packed form (not counted by ``model.parameters()``).
    """
    from pagedllm.models.layers import Linear

    if float32 is None:
        float32 = float32_packing_wanted() and all(
            m.weight.numel() >= FLOAT32_PACK_MIN_ELEMENTS for m in model.modules()
            if isinstance(m, Linear) and m.quant_method is None and m.weight.dtype == torch.float32)
    dtypes = (torch.bfloat16, torch.float32) if float32 else (torch.bfloat16,)
    extra = 0
    method = OneDNNPackedLinearMethod()
    for m in list(model.modules()):
        if isinstance(m, Linear) and m.quant_method is None and m.weight.dtype in dtypes:
            packed = pack_weight(m.weight)
            if packed is None:
                continue
            extra += m.weight.numel() * m.weight.element_size()
            m.onednn_weight, m.quant_method = packed, method
            m.weight = nn.Parameter(torch.empty(0, dtype=m.weight.dtype), requires_grad=False)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lp = getattr(model, "logits_processor", None)
    if pack_head and getattr(model, "lm_head", True) is None and embed is not None and lp is not None \
            and lp.tied_head is None and lp.quant_method is None and embed.weight.dtype in dtypes \
            and lp.emits_logits:  # (a pipeline stage before the last computes no logits)
        packed = pack_weight(embed.weight)
        if packed is not None:
            # NOTE: the dense table stays for lookups (and non-bf16 inputs)
            embed.onednn_weight, lp.quant_method = packed, method
            extra += embed.weight.numel() * embed.weight.element_size()
    return extra
