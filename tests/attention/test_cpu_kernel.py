"""The C++ paged decode kernel equals the pure-torch decode path (the oracle)."""
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
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 256, 16), (8, 8, 32, 4), (6, 2, 128, 1)])
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
