"""CPU paged attention in plain torch; also the reference oracle for other backends.

Decodes (one query token each) use a batched manual grouped matmul -> float32 softmax ->
matmul, which on CPU is much faster than SDPA at q_len=1 (docs/hardware-and-models.md,
"Which torch ops are fast or slow"). Prefill chunks use
``F.scaled_dot_product_attention`` per request over the context gathered from the cache,
except with a logit soft-cap, which SDPA cannot express (manual path then).

With the C++ kernels (the default), the cache store and decode attention run in C++, and so does
bf16 prefill attention on CPUs with AVX512-BF16; the torch code here stays the oracle.

An 8-bit cache (``kv_cache_dtype`` fp8: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``) stores
``to_cache_dtype(k)`` and is read widened to the query dtype (exact), by the C++ kernels for bf16
queries with head size 64/128/256, else by the torch path here. A bf16 (or fp16) cache under a
float32 model (``kv_cache_dtype`` "bfloat16", the CPU default where the model runs in float32
because the CPU lacks native bf16) is stored rounded to nearest even and read widened to float32,
by the C++ store and decode kernels, and by the gather path here for prefill.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionImpl, AttentionMetadata


def build_metadata(reqs: list[tuple[int, int, list[int]]], block_size: int) -> AttentionMetadata:
    """Build the metadata for one step by hand (tests, dummy runs).

    Args:
        reqs: per request ``(start_pos, num_new_tokens, block_ids)``: the request already has
            ``start_pos`` tokens in the cache and computes ``num_new_tokens`` more, stored in
            ``block_ids`` (which must cover ``start_pos + num_new_tokens`` tokens). Requests with
            one new token must come first (they are the decodes).
        block_size: tokens per block.

    Returns:
        AttentionMetadata with int64 CPU tensors.

    Raises:
        ValueError: if a one-token request follows a multi-token one, or blocks are too few.
    """
    num_decodes = 0
    while num_decodes < len(reqs) and reqs[num_decodes][1] == 1:
        num_decodes += 1
    if any(n == 1 for _, n, _ in reqs[num_decodes:]):
        raise ValueError("build_metadata: one-token (decode) requests must come first")
    query_lens = [n for _, n, _ in reqs]
    seq_lens = [s + n for s, n, _ in reqs]
    max_blocks = max([len(b) for _, _, b in reqs] + [1])
    block_tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int64)
    slots: list[int] = []
    for i, (start, n, blocks) in enumerate(reqs):
        if len(blocks) * block_size < start + n:
            raise ValueError(f"build_metadata: request {i} needs {start + n} slots, has {len(blocks)} blocks")
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0)
    return AttentionMetadata(
        num_reqs=len(reqs),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=qsl,
        query_lens=query_lens,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_list=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=block_size,
        max_seq_len=max(seq_lens, default=0),
    )


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the KV cache's dtype; fp8 saturates at the format's largest finite value (448 for
    E4M3, 57344 for E5M2), as vLLM's conversion does, where a plain ``.to()`` gives NaN / inf."""
    if dtype in FP8_DTYPES:
        m = torch.finfo(dtype).max
        return x.float().clamp(-m, m).to(dtype)
    return x.to(dtype)


HALF_DTYPES = (torch.bfloat16, torch.float16)
#: query rows per attention call of a masked prefill chunk (``_prefill``): bounds the mask, and the
#: soft-cap path's float32 scores, to ``PREFILL_Q_BLOCK x context`` (a 2,048-token chunk over an
#: 8,192-token context: 2 MiB of bool mask and 8 MiB of float mask instead of 16 + 64 MiB)
PREFILL_Q_BLOCK = 256


def kernel_reads_cache(ops, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ attention kernels read ``kv_cache`` for queries ``q``: the same dtype, an fp8
    cache with bf16 q where the build supports it, or a bf16/fp16 cache with float32 q (decode)."""
    if ops is None or q.device.type != "cpu":
        return False
    if q.dtype == kv_cache.dtype:
        return True
    if q.dtype == torch.float32 and kv_cache.dtype in HALF_DTYPES:
        return hasattr(ops, "kv_half_f32_supported")
    return kv_cache.dtype in FP8_DTYPES and hasattr(ops, "kv_fp8_supported") and ops.kv_fp8_supported(q)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             ops=None) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` at flat slots ``slot_mapping`` ``[T]`` (-1 = skip).

    ``ops``: the C++ CPU kernels (``reshape_and_cache``, one pass) or None for the torch path.
    An fp8 cache stores ``to_cache_dtype(k)`` (round to nearest even, saturating) either way.
    """
    same = (k.dtype == kv_cache.dtype
            or (kv_cache.dtype in FP8_DTYPES and hasattr(ops, "kv_fp8_supported")
                and k.dtype in (torch.float32, torch.bfloat16))
            or (kv_cache.dtype in HALF_DTYPES and k.dtype == torch.float32 and hasattr(ops, "kv_half_f32_supported")))
    if (ops is not None and same and v.dtype == k.dtype and kv_cache.is_contiguous()
            and k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.device.type == "cpu"
            and slot_mapping.dtype == torch.int64):
        ops.reshape_and_cache(k, v, kv_cache, slot_mapping)
        return
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    kv_cache[blk, 0, off] = to_cache_dtype(k, kv_cache.dtype)
    kv_cache[blk, 1, off] = to_cache_dtype(v, kv_cache.dtype)


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``blocks`` (int64 ``[B, n]``), head-major: ``[B, Hkv, n * block_size, D]`` each.

    NOTE: one ``index_select`` then one permuting copy per K/V measured fastest on CPU (plain
    advanced indexing of the strided K view was ~3x slower; matmul on token-major K copies anyway).
    """
    b, n = blocks.shape
    _, _, bs, h, d = kv_cache.shape
    x = kv_cache.index_select(0, blocks.reshape(-1)).view(b, n, 2, bs, h, d)
    k = x[:, :, 0].permute(0, 3, 1, 2, 4).reshape(b, h, n * bs, d)
    v = x[:, :, 1].permute(0, 3, 1, 2, 4).reshape(b, h, n * bs, d)
    return k, v


def _manual_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    soft_cap: Optional[float],
) -> torch.Tensor:
    """Grouped attention with float32 softmax.

    Args:
        q: ``[B, Hq, Lq, D]``; k, v: ``[B, Hkv, Lk, D]``; allowed: bool, broadcastable to
            ``[B, 1, Lq, Lk]``.

    Returns:
        ``[B, Hq, Lq, D]`` in v's dtype. A row with no allowed key gives zeros.
    """
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (hq // hkv) * lq, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().view(b, hkv, hq // hkv, lq, -1) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    out = torch.matmul(probs.to(v.dtype).view(b, hkv, -1, probs.shape[-1]), v)
    return out.view(b, hq, lq, d)


class TorchPagedAttention(AttentionImpl):
    """Paged attention on CPU (see ``AttentionImpl.forward`` for the contract).

    Args:
        use_cpu_kernel: use the C++ kernels (``pagedllm.kernels.cpu_ops``) when available: the
            KV-cache store, decode attention, and (bf16 with AVX512-BF16) prefill attention, all
            reading K/V through the block table instead of gathering a contiguous copy. False
            keeps the pure-torch path (the test oracle).
    """

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self._ops = None
        if use_cpu_kernel:
            from pagedllm.kernels.cpu_ops import get_ops
            self._ops = get_ops()

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv(kv_cache, k, v, meta.slot_mapping, self._ops)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, sliding_window: Optional[int], logits_soft_cap: Optional[float]) -> torch.Tensor:
        """Attend decodes (batched) and prefill chunks (each)."""
        nd = meta.num_decodes
        use_kernel = kernel_reads_cache(self._ops, q, kv_cache)
        if nd == meta.num_reqs and use_kernel:  # a decode-only step: the kernel's output is the result
            return self._ops.paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, float(scale),
                int(sliding_window or 0), float(logits_soft_cap or 0.0))
        out = torch.empty_like(q)
        if nd > 0:
            if use_kernel:
                out[:nd] = self._ops.paged_decode_attention(
                    q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], float(scale),
                    int(sliding_window or 0), float(logits_soft_cap or 0.0))
            else:
                out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, sliding_window, logits_soft_cap)
        bs = meta.block_size
        same_dtype = kv_cache.dtype == k.dtype
        # NOTE: the C++ prefill kernel reads K/V through the block table (no gather) and beats
        # SDPA on short prompts (docs/performance.md); bf16 with AVX512-BF16 only.
        prefill_kernel = use_kernel and nd < meta.num_reqs and self._ops.prefill_supported(q)
        bidir_all = meta.bidirectional_ranges
        for i in range(nd, meta.num_reqs):
            qs, ql = int(meta.query_start_loc[i]), meta.query_lens[i]
            seq_len = meta.seq_lens_list[i]
            ctx = seq_len - ql
            # NOTE: image runs this chunk's queries are in: those need the explicit mask (torch path)
            bidir = ([(a, b) for a, b in bidir_all[i] or () if a < seq_len and b > ctx]
                     if bidir_all is not None else None) or None
            if prefill_kernel and bidir is None:
                out[qs : qs + ql] = self._ops.paged_prefill_attention(
                    q[qs : qs + ql], kv_cache, meta.block_tables[i], ctx, float(scale),
                    int(sliding_window or 0), float(logits_soft_cap or 0.0))
                continue
            if ctx == 0 and same_dtype:
                # NOTE: no earlier context: the new k/v are exactly what the cache holds.
                kc, vc, first = k[qs : qs + ql].transpose(0, 1), v[qs : qs + ql].transpose(0, 1), 0
            else:
                first = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
                first = (first // bs) * bs  # gather whole blocks from here
                blocks = meta.block_tables[i : i + 1, first // bs : math.ceil(seq_len / bs)]
                kc, vc = _gather(kv_cache, blocks)
                kc, vc = kc[0, :, : seq_len - first].to(q.dtype), vc[0, :, : seq_len - first].to(q.dtype)
            if bidir is not None:
                bidir = [(a - first, b - first) for a, b in bidir]
            out[qs : qs + ql] = self._prefill(
                q[qs : qs + ql], kc, vc, ctx - first, scale, sliding_window, logits_soft_cap, bidir
            )
        return out

    @staticmethod
    def _decode(q, kv_cache, meta, scale, window, soft_cap) -> torch.Tensor:
        """q ``[Bd, Hq, D]`` -> ``[Bd, Hq, D]``; context gathered padded to the longest."""
        nd, bs = meta.num_decodes, meta.block_size
        seq_lens = meta.seq_lens[:nd]
        max_len = max(meta.seq_lens_list[:nd])
        first_blk = 0
        if window is not None:
            # NOTE: keys older than every decode's window are never needed.
            first_blk = max(0, min(meta.seq_lens_list[:nd]) - window) // bs
        blocks = meta.block_tables[:nd, first_blk : math.ceil(max_len / bs)]
        kc, vc = _gather(kv_cache, blocks)  # [Bd, Hkv, L, D]
        kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        kpos = torch.arange(first_blk * bs, first_blk * bs + kc.shape[2]).unsqueeze(0)  # [1, L]
        qpos = (seq_lens - 1).unsqueeze(1)  # [Bd, 1]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        out = _manual_attention(q.unsqueeze(2), kc, vc, allowed[:, None, None, :], scale, soft_cap)
        return out.squeeze(2)

    @staticmethod
    def _prefill(q, kc, vc, q_offset, scale, window, soft_cap, bidir=None) -> torch.Tensor:
        """q ``[Lq, Hq, D]`` at positions ``q_offset + i``; kc/vc ``[Hkv, Lk, D]`` at ``0..Lk-1``.

        ``bidir``: ``[start, end)`` ranges (in kc's positions) whose tokens see each other whatever
        the order (image runs; HF Gemma 3: ``window AND (causal OR same-range)``); None = causal.

        A chunk that needs a mask (earlier context, a window or a soft-cap) runs in blocks of
        ``PREFILL_Q_BLOCK`` query rows (bit-identical: each row's result does not depend on the other
        rows): the mask (and the soft-cap path's scores) are then at most ``PREFILL_Q_BLOCK x Lk``
        instead of ``Lq x Lk``."""
        lq = q.shape[0]
        if lq > PREFILL_Q_BLOCK and (window is not None or q_offset != 0 or soft_cap is not None or bidir):
            return torch.cat([
                TorchPagedAttention._prefill_rows(q[r:r + PREFILL_Q_BLOCK], kc, vc, q_offset + r, scale, window,
                                                  soft_cap, bidir)
                for r in range(0, lq, PREFILL_Q_BLOCK)])
        return TorchPagedAttention._prefill_rows(q, kc, vc, q_offset, scale, window, soft_cap, bidir)

    @staticmethod
    def _prefill_rows(q, kc, vc, q_offset, scale, window, soft_cap, bidir=None) -> torch.Tensor:
        # NOTE: every block sees all of kc / vc (the later keys masked): cutting them to the visible
        # ones changes SDPA's tiling and the last bits of the result
        lq, lk = q.shape[0], kc.shape[1]
        qt, kt, vt = q.transpose(0, 1).unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0)
        allowed = None
        if window is not None or q_offset != 0 or soft_cap is not None or bidir:
            qpos = torch.arange(q_offset, q_offset + lq).unsqueeze(1)
            kpos = torch.arange(lk).unsqueeze(0)
            allowed = kpos <= qpos
            for a, b in bidir or ():
                allowed |= (qpos >= a) & (qpos < b) & (kpos >= a) & (kpos < b)
            if window is not None:
                allowed &= kpos > qpos - window
        if soft_cap is not None:
            out = _manual_attention(qt, kt, vt, allowed.unsqueeze(0), scale, soft_cap).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=allowed, is_causal=allowed is None, scale=scale,
                enable_gqa=kt.shape[1] != qt.shape[1],
            )
        return out.squeeze(0).transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     sliding_window: Optional[int], logits_soft_cap: Optional[float]) -> torch.Tensor:
    """The whole batch as one causal sequence, nothing cached: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``
    -> ``[T, Hq, D]`` (every backend's dummy/profiling run, ``AttentionImpl.forward(meta=None)``)."""
    return TorchPagedAttention._prefill(q, k.transpose(0, 1), v.transpose(0, 1), 0, scale, sliding_window,
                                        logits_soft_cap)
