"""Paged attention in Triton: the CUDA backend (also runs on CPU under ``TRITON_INTERPRET=1``).

Two kernels:

* ``_reshape_and_cache_kernel``: one program per (new token, kv head) stores the token's K and V
  rows at ``slot_mapping[t]`` of the paged cache; slot ``-1`` (padding) is skipped.
* ``_paged_attention_kernel``: one program per (query block, kv head). A query block is up to
  ``BLOCK_Q`` consecutive query tokens of one request; its tile has ``BLOCK_Q * G_PAD`` rows
  (token x the ``G = Hq / Hkv`` query heads that share the kv head, so GQA loads each K/V tile
  once for the group). The program walks the request's context ``TILE_N`` keys at a time through
  the block table (the physical block of every key is looked up, so any block size works),
  with an fp32 online softmax. Causal (a query at absolute position p sees keys <= p), optional
  sliding window (keys > p - window) and logits soft cap (``cap * tanh(s / cap)``).

The program -> request mapping is a binary search over ``query_start_loc`` inside the kernel
(vLLM's unified-attention trick: query block ``j`` of request ``i`` has global index
``query_start_loc[i] // BLOCK_Q + i + j``), so the grid depends only on (T, B): no host sync,
and CUDA-graph capturable.

Device of the metadata: the model runner builds ``AttentionMetadata`` on the CPU. This backend
moves the four index tensors to q's device on first use in a forward pass (non-blocking copies;
pinned sources make them truly async) and caches the moved copies on the metadata object, so the
other layers of the same forward reuse them. A runner that already builds them on the device pays
nothing.
"""
from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from pagedllm.attention.backend import AttentionImpl, AttentionMetadata

_DEV_ATTR = "_pagedllm_device_tensors"


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    d = tl.arange(0, D_PAD)
    dm = d < HEAD_DIM
    t64 = t.to(tl.int64)
    kv = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=dm)
    vv = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=dm)
    base = cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d
    tl.store(base, kv.to(cache_ptr.dtype.element_ty), mask=dm)
    tl.store(base + stride_ckv, vv.to(cache_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _find_request(qsl_ptr, target, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest i with ``qsl[i] // BLOCK_Q + i <= target`` (binary search)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    num_reqs, scale, soft_cap, window,
    stride_ot, stride_oh, stride_qt, stride_qh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, IEEE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    req = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    qb = pid - (q_start // BLOCK_Q + req)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens already in the cache before this step

    M: tl.constexpr = BLOCK_Q * G_PAD
    rows = tl.arange(0, M)
    q_tok = qb * BLOCK_Q + rows // G_PAD  # token index within the request's queries
    g = rows % G_PAD
    row_ok = (q_tok < q_len) & (g < G)
    q_pos = ctx_len + q_tok  # absolute position of each row's query
    head = kvh * G + g
    d = tl.arange(0, D_PAD)
    dm = d < HEAD_DIM

    tok = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & dm[None, :], other=0.0)

    # Keys this block needs: [lo, hi).
    first_pos = ctx_len + qb * BLOCK_Q
    hi = tl.minimum(first_pos + BLOCK_Q, seq_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        lo = (lo // TILE_N) * TILE_N

    m_i = tl.full([M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    n_offs = tl.arange(0, TILE_N)
    for start in range(lo, hi, TILE_N):
        k_pos = start + n_offs
        k_ok = k_pos < hi
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kmask = k_ok[:, None] & dm[None, :]
        k = tl.load(cache_ptr + kv_off[:, None] + d[None, :], mask=kmask, other=0.0).to(q.dtype)
        v = tl.load(cache_ptr + stride_ckv + kv_off[:, None] + d[None, :], mask=kmask, other=0.0).to(q.dtype)
        if DOT_F32:  # interpreter: its 16-bit tl.dot is wrong (triton 3.7), multiply in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if USE_SOFT_CAP:
            x = s / soft_cap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = soft_cap * tl.where(x >= 0, th, -th)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        elif IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no allowed key gives zeros (as the torch backend)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


# ----------------------------------------------------------------------------- host side
def _interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def device_tensors(meta: AttentionMetadata, device: torch.device):
    """``(query_start_loc, seq_lens, block_tables, slot_mapping)`` on ``device``, cached on ``meta``.

    Copies are non-blocking (async when the CPU tensors are pinned); done once per forward pass.
    """
    cached = getattr(meta, _DEV_ATTR, None)
    if cached is not None and cached[0] == device:
        return cached[1]
    ts = tuple(
        t if t.device == device else t.to(device, non_blocking=True)
        for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping)
    )
    setattr(meta, _DEV_ATTR, (device, ts))
    return ts


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` (-1 = skip) of ``kv_cache``."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.stride(-1) == 1
    _reshape_and_cache_kernel[(t, hkv)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=d, D_PAD=max(16, _pow2(d)),
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_reqs: int,
    scale: float,
    sliding_window: Optional[int],
    logits_soft_cap: Optional[float],
    out: Optional[torch.Tensor] = None,
    tile_n: Optional[int] = None,
) -> torch.Tensor:
    """Attend ``q`` ``[T, Hq, D]`` over the paged ``kv_cache`` (all index tensors on q's device)."""
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"paged_attention: {hq} query heads not a multiple of {hkv} kv heads")
    if d > 256:
        raise ValueError(f"paged_attention: head_dim {d} > 256 unsupported")
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or num_reqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    g = hq // hkv
    g_pad = _pow2(g)
    block_q = max(1, 16 // g_pad)  # tl.dot needs >= 16 rows
    d_pad = max(16, _pow2(d))
    if tile_n is None:
        tile_n = max(16, min(64, block_size)) if d_pad <= 128 else max(16, min(32, block_size))
    grid = (t // block_q + num_reqs, hkv)
    _paged_attention_kernel[grid](
        out, q, kv_cache, block_tables, seq_lens, query_start_loc,
        num_reqs, float(scale), float(logits_soft_cap or 0.0), int(sliding_window or 0),
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        G=g, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
        IEEE_DOT=q.dtype == torch.float32, DOT_F32=_interpreting() and q.dtype != torch.float32,
    )
    return out


class TritonPagedAttention(AttentionImpl):
    """Paged attention through the Triton kernels (see ``AttentionImpl.forward`` for the contract).

    Requirements: head_dim a power of two <= 256 (others are padded to one internally),
    ``kv_cache`` contiguous in its last dim, Hq % Hkv == 0. Metadata tensors may live on any
    device (moved once per forward pass, see the module docstring).
    """

    name = "triton"

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        reshape_and_cache(k, v, kv_cache, device_tensors(meta, k.device)[3])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: Optional[int], logits_soft_cap: Optional[float]) -> torch.Tensor:
        qsl, seq_lens, block_tables, _ = device_tensors(meta, q.device)
        return paged_attention(q, kv_cache, qsl, seq_lens, block_tables, meta.num_reqs, scale,
                               sliding_window, logits_soft_cap)
