"""The C++ paged decode and prefill kernels equal the pure-torch paths (the oracle)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.kernels.cpu_ops import get_ops
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

ops = get_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ CPU kernels could not be built here")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 256, 16), (8, 8, 32, 4), (6, 2, 128, 1), (16, 2, 64, 4),
                                         (12, 1, 128, 16), (10, 2, 80, 16), (21, 3, 96, 4)])
@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 20.0), (33, 5.0)])
def test_kernel_matches_torch_decode(dtype, tol, hq, hkv, d, bs, window, cap):
    rng = random.Random(hq * 1000 + d + bs)
    nb = 400
    kv = torch.randn(nb, 2, bs, hkv, d).to(dtype)
    blocks_free = list(range(1, nb))
    rng.shuffle(blocks_free)
    reqs = []
    for L in [1, 2, bs, bs + 1, 3 * bs + 5, 77]:
        n = math.ceil(L / bs)
        blocks, blocks_free = blocks_free[:n], blocks_free[n:]
        reqs.append((L - 1, 1, blocks))
    meta = build_metadata(reqs, bs)
    q = torch.randn(len(reqs), hq, d).to(dtype)
    ref = TorchPagedAttention._decode(q, kv, meta, d ** -0.5, window, cap)
    out = ops.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, d ** -0.5, window or 0, cap or 0.0)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_backend_uses_kernel_and_agrees_in_a_mixed_batch():
    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 16
    kv_a = torch.zeros(50, 2, bs, hkv, d)
    kv_b = torch.zeros_like(kv_a)
    reqs = [(5, 1, [1, 2]), (9, 1, [3, 4, 5]), (3, 6, [6, 7, 8])]
    meta = build_metadata(reqs, bs)
    T = sum(n for _, n, _ in reqs)
    # fill earlier context identically
    ctx = torch.randn(50, 2, bs, hkv, d)
    kv_a.copy_(ctx)
    kv_b.copy_(ctx)
    q, k, v = torch.randn(T, hq, d), torch.randn(T, hkv, d), torch.randn(T, hkv, d)
    with_kernel = TorchPagedAttention(use_cpu_kernel=True)
    assert with_kernel._ops is not None
    a = with_kernel.forward(q, k, v, kv_a, meta, 0.25, None, None)
    b = TorchPagedAttention(use_cpu_kernel=False).forward(q, k, v, kv_b, meta, 0.25, None, None)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_a, kv_b)


PREFILL = ops is not None and ops.prefill_supported(torch.empty(1, 1, 64, dtype=torch.bfloat16))


@pytest.mark.skipif(not PREFILL, reason="the C++ prefill kernel needs AVX512-BF16")
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 256, 16), (4, 4, 128, 4)])
@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (None, 20.0), (40, 5.0)])
@pytest.mark.parametrize("ctx,lq", [(0, 1), (0, 37), (0, 300), (21, 16), (50, 45)])
def test_prefill_kernel_matches_torch_prefill(hq, hkv, d, bs, window, cap, ctx, lq):
    """One request's chunk of ``lq`` queries after ``ctx`` cached tokens, bf16, vs the SDPA/manual path."""
    rng = random.Random(hq + d + ctx + lq)
    L = ctx + lq
    n = math.ceil(L / bs)
    nb = n + 20
    blocks = rng.sample(range(1, nb), n)
    kv = (torch.randn(nb, 2, bs, hkv, d, generator=torch.Generator().manual_seed(lq)) * 2).to(torch.bfloat16)
    meta = build_metadata([(ctx, lq, blocks)], bs)
    q = torch.randn(lq, hq, d, generator=torch.Generator().manual_seed(ctx)).to(torch.bfloat16)
    scale = d ** -0.5
    out = ops.paged_prefill_attention(q, kv, meta.block_tables[0], ctx, scale, window or 0, cap or 0.0)
    # reference: gather this request's K/V ([Hkv, L, D]) and run the torch prefill
    pos = torch.arange(L)
    bt = meta.block_tables[0]
    kc = kv[bt[pos // bs], 0, pos % bs].transpose(0, 1)
    vc = kv[bt[pos // bs], 1, pos % bs].transpose(0, 1)
    # NOTE: float32 reference on the same bf16 inputs (the bf16 torch path rounds its scores to
    # bf16 before the soft cap, which is less exact than the kernel's float32 scores).
    ref = TorchPagedAttention._prefill(q.float(), kc.float(), vc.float(), ctx, scale, window, cap)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not PREFILL, reason="the C++ prefill kernel needs AVX512-BF16")
def test_backend_prefill_kernel_in_a_mixed_bf16_batch():
    """Decodes + two prefill chunks in one step, bf16: kernel backend vs the pure-torch backend."""
    torch.manual_seed(1)
    bs, hq, hkv, d = 16, 9, 3, 64
    reqs = [(5, 1, [1]), (40, 1, [2, 3, 4]), (0, 70, [5, 6, 7, 8, 9]), (20, 30, [10, 11, 12, 13])]
    meta = build_metadata(reqs, bs)
    T = sum(n for _, n, _ in reqs)
    ctx = torch.randn(20, 2, bs, hkv, d).to(torch.bfloat16)
    kv_a, kv_b = ctx.clone(), ctx.clone()
    q, k, v = (torch.randn(T, h, d).to(torch.bfloat16) for h in (hq, hkv, hkv))
    a = TorchPagedAttention(use_cpu_kernel=True).forward(q, k, v, kv_a, meta, d ** -0.5, None, None)
    b = TorchPagedAttention(use_cpu_kernel=False).forward(q, k, v, kv_b, meta, d ** -0.5, None, None)
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(kv_a, kv_b)


@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 256), (9, 3, 64), (12, 1, 128)])
def test_decode_kernel_split_over_threads_matches_torch(hq, hkv, d):
    """A long context on 2 threads: the (request, kv head) items, and when they are fewer than the
    threads the query heads of a kv head too, run on both threads; each head equals the oracle."""
    bs, L = 16, 700
    nb = L // bs + 1
    kv = torch.randn(nb + 3, 2, bs, hkv, d).to(torch.bfloat16)
    blocks = list(range(1, nb + 1))
    random.Random(7).shuffle(blocks)
    meta = build_metadata([(L - 1, 1, blocks)], bs)
    q = torch.randn(1, hq, d)
    ref = TorchPagedAttention._decode(q, kv, meta, d ** -0.5, None, None)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = ops.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, d ** -0.5, 0, 0.0)
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)



def _both_splits(q, kv, lens, bs, window, cap, threads, seed, monkeypatch):
    """Run ``paged_decode_attention`` over requests of context lengths ``lens`` (blocks of ``kv``
    shuffled by ``seed``) on ``threads`` threads, split per (request, kv head)
    (PAGEDLLM_DECODE_PER_HEAD=1) and request-wise; returns (per_head, request_wise, metadata)."""
    rng = random.Random(seed)
    free = list(range(1, kv.shape[0]))
    rng.shuffle(free)
    reqs = []
    for L in lens:
        n = math.ceil(L / bs)
        reqs.append((L - 1, 1, free[:n]))
        free = free[n:]
    meta = build_metadata(reqs, bs)
    args = (q, kv, meta.block_tables, meta.seq_lens, q.shape[-1] ** -0.5, window or 0, cap or 0.0)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setenv("PAGEDLLM_DECODE_PER_HEAD", "1")
        per_head = ops.paged_decode_attention(*args)
        monkeypatch.setenv("PAGEDLLM_DECODE_PER_HEAD", "0")
        request_wise = ops.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(prev)
    return per_head, request_wise, meta


@pytest.mark.skipif(not PREFILL, reason="the request-wise decode kernel needs AVX512-BF16")
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 256), (16, 2, 128), (6, 6, 64)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window,cap", [(None, None), (40, 10.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_request_wise_decode_equals_the_per_head_split(hq, hkv, d, kv_dtype, window, cap, threads, monkeypatch):
    """bf16 decode walks whole requests per thread (``decode_request_bf16``: one pass over the K
    rows for every head, prefetching K and V ahead) where there are enough requests; the outputs
    are bit-identical to the per-(request, kv head) split (PAGEDLLM_DECODE_PER_HEAD=1), over
    requests of 1 to 900 tokens (900 keeps more K and V than the kernel holds in L2 and prefetches
    V in its P.V pass instead), shuffled blocks, fp8 caches, a window and a soft cap, and close to
    the torch oracle."""
    bs, lens = 16, [1, 15, 16, 17, 100, 333, 900, 48, 2]
    kv = (torch.randn(sum(math.ceil(L / bs) for L in lens) + 4, 2, bs, hkv, d) * 0.5).to(kv_dtype)
    q = torch.randn(len(lens), hq, d).to(torch.bfloat16)
    per_head, request_wise, meta = _both_splits(q, kv, lens, bs, window, cap, threads, hq * 31 + d, monkeypatch)
    assert torch.equal(request_wise, per_head)
    ref = TorchPagedAttention._decode(q.float(), kv.float(), meta, d ** -0.5, window, cap)
    torch.testing.assert_close(request_wise.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 256), (16, 2, 128), (6, 6, 80)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window,cap", [(None, None), (40, 10.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_request_wise_decode_equals_the_per_head_split(hq, hkv, d, kv_dtype, window, cap, threads,
                                                               monkeypatch):
    """The float32-q kernel (AVX2, CPUs without AVX512-BF16 and float32 models) walks whole
    requests too (``decode_request_f32``): bit-identical to its per-(request, kv head) split and
    close to the torch oracle, over the same kind of requests as the bf16 test above."""
    bs, lens = 16, [1, 7, 8, 9, 100, 333, 900, 48, 2]
    kv = (torch.randn(sum(math.ceil(L / bs) for L in lens) + 4, 2, bs, hkv, d) * 0.5).to(kv_dtype)
    q = torch.randn(len(lens), hq, d)
    per_head, request_wise, meta = _both_splits(q, kv, lens, bs, window, cap, threads, hq * 17 + d, monkeypatch)
    assert torch.equal(request_wise, per_head)
    ref = TorchPagedAttention._decode(q, kv.float(), meta, d ** -0.5, window, cap)
    torch.testing.assert_close(request_wise, ref, atol=1e-4, rtol=1e-4)
