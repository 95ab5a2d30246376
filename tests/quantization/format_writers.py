"""Test helpers: quantized checkpoint tensors written from the formats' published layouts
(GPTQ, AWQ) or by the compressed-tensors library itself, each with its float32 reference weight.

Every writer quantizes a float ``w [N, K]`` by round-to-nearest (the packing is what is under
test, not the calibration) and returns ``(tensors, reference)``: the checkpoint tensors of one
linear layer (names without the module prefix) and ``reference``, the float32 weight those
tensors mean (``scale * (code - zero)`` computed in float32 from the unpacked codes).
"""
from __future__ import annotations

from typing import Optional

import torch


def _pack(codes: torch.Tensor, bits: int, dim: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """Unsigned codes -> int32 words, ``32 / bits`` consecutive codes along ``dim`` per word,
    code ``j`` of each run in bit field ``order.index(j)`` (default: field j)."""
    per = 32 // bits
    c = codes.to(torch.int64)
    if dim == 0:
        c = c.t()
    r, n = c.shape
    c = c.reshape(r, n // per, per)
    if order is not None:
        c = c[:, :, order]  # field i holds code order[i]
    words = torch.zeros(r, n // per, dtype=torch.int64)
    for i in range(per):
        words |= c[:, :, i] << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words.contiguous()


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, n_groups: int, bits: int, sym: bool):
    """Per (output, group) scale and integer zero by min/max; codes ``[N, K]`` in 0..2^bits-1."""
    maxq = 2**bits - 1
    n, k = w.shape
    scales = torch.empty(n, n_groups)
    zeros = torch.empty(n, n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            amax = torch.maximum(-lo, hi).clamp(min=1e-8)
            s = 2 * amax / maxq
            z = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            s = ((hi - lo) / maxq).clamp(min=1e-8)
            z = torch.round(-lo / s).to(torch.int64).clamp(0, maxq)
        scales[:, g], zeros[:, g] = s, z
    scales = scales.half()  # as the checkpoints store them
    s_k, z_k = scales.float()[:, g_idx], zeros[:, g_idx]
    codes = torch.clamp(torch.round(w / s_k) + z_k, 0, maxq).to(torch.int64)
    ref = s_k * (codes - z_k).float()
    return codes, scales, zeros, ref


def gptq_tensors(w: torch.Tensor, bits: int = 4, group: int = 32, sym: bool = True, desc_act: bool = False,
                 v1: bool = True, seed: int = 0):
    """AutoGPTQ layout: qweight int32 [K/p, N], qzeros int32 [G, N/p] (v1: zero - 1 mod 2^bits),
    scales fp16 [G, N], g_idx int32 [K] (a random act-order when ``desc_act``)."""
    n, k = w.shape
    gs = group if group > 0 else k
    ng = -(-k // gs)
    if desc_act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // gs
    else:
        g_idx = torch.arange(k) // gs
    codes, scales, zeros, ref = _rtn(w.float(), g_idx, ng, bits, sym)
    stored = (zeros - 1) % (2**bits) if v1 else zeros
    t = {"qweight": _pack(codes.t(), bits, dim=0), "qzeros": _pack(stored.t(), bits, dim=1),
         "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    return t, ref


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_tensors(w: torch.Tensor, group: int = 32):
    """AutoAWQ GEMM layout: qweight int32 [K, N/8], qzeros int32 [G, N/8] (AWQ_ORDER interleave),
    scales fp16 [G, N]."""
    n, k = w.shape
    g_idx = torch.arange(k) // group
    codes, scales, zeros, ref = _rtn(w.float(), g_idx, k // group, 4, sym=False)
    t = {"qweight": _pack(codes.t(), 4, dim=1, order=AWQ_ORDER),
         "qzeros": _pack(zeros.t(), 4, dim=1, order=AWQ_ORDER),
         "scales": scales.t().contiguous()}
    return t, ref


def ct_scheme(preset: str, **weight_overrides):
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(preset, ["Linear"])
    for key, v in weight_overrides.items():
        setattr(s.weights, key, v)
    return s


def ct_tensors(w: torch.Tensor, scheme, fmt: str):
    """compressed-tensors' own compressor output for ``w`` under ``scheme`` (qparams by the
    library's ``calculate_qparams`` over min/max), and the library's decompression of it with
    float32 scales (the reference)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    n, k = w.shape
    if args.strategy == "group":
        v = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = v.amin(-1), v.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        v = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = v.amin((1, 3)), v.amax((1, 3))
    else:
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    scale, zp = calculate_qparams(lo, hi, args)
    sd = {"weight": w, "weight_scale": scale}
    if not args.symmetric:
        sd["weight_zero_point"] = zp
    comp = BaseCompressor.load_from_registry(fmt)
    out = comp.compress(sd, scheme)
    back = comp.decompress({key: (val.float() if key == "weight_scale" else val) for key, val in out.items()}, scheme)
    return out, back["weight"].float()
