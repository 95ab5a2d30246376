"""The batch-invariant C++ kernels (``pagedllm.kernels.batch_invariant``): values against float64
references, and bit-identical rows however the work is batched, split or threaded."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.batch_invariant import bi_linear, get_bi_ops

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    return get_bi_ops()


# ------------------------------------------------------------------ linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1536, 576), (13, 129), (3, 37), (40, 8)])
def test_linear_values_and_row_invariance(dtype, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(130, k, generator=g).to(dtype)
    full = bi_linear(x, w, b)
    assert full.dtype == dtype and full.shape == (130, n)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (full.double() - ref).abs().max().item() < TOL[dtype] * max(1.0, ref.abs().max().item())
    rng = random.Random(k)
    for _ in range(12):  # any run of rows, any count: the same bits as in the full product
        m0 = rng.randrange(0, 129)
        m1 = rng.randrange(m0 + 1, 131)
        assert torch.equal(bi_linear(x[m0:m1], w, b), full[m0:m1]), (m0, m1)
    assert torch.equal(bi_linear(x[:1], w, b), full[:1])
    # a permuted batch permutes the rows and nothing else
    perm = torch.randperm(130, generator=g)
    assert torch.equal(bi_linear(x[perm], w, b), full[perm])
    # without bias; 3-D input
    nb = bi_linear(x, w)
    assert torch.equal(bi_linear(x.view(10, 13, k), w).view(130, n), nb)


def test_linear_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(700, 300, generator=g)
    x = torch.randn(50, 300, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bi_linear(x, w)
        torch.set_num_threads(2)
        two = bi_linear(x, w)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_linear_errors(ops):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.linear(x, torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        ops.linear(x, torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(x, torch.randn(3, 8), torch.randn(4))


# ------------------------------------------------------------------ attention


def _reference(q, keys, values, qpos, scale, window, soft_cap):
    """float64 attention of q ``[Hq, D]`` at position qpos over keys/values ``[L, Hkv, D]``."""
    hq, _ = q.shape
    g = hq // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hq):
        s = keys[: qpos + 1, h // g] @ q[h].double() * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        if window:
            s[: max(0, qpos - window + 1)] = -math.inf
        out[h] = torch.softmax(s, 0) @ values[: qpos + 1, h // g]
    return out


class _Cache:
    """A random paged cache and block tables for a few requests (blocks scattered)."""

    def __init__(self, dtype, hkv, d, bs=16, num_blocks=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.bs, self.g = bs, g
        self.kv = torch.randn(num_blocks, 2, bs, hkv, d, generator=g).to(dtype)
        self.free = torch.randperm(num_blocks, generator=g).tolist()

    def table(self, n_tokens):
        return [self.free.pop() for _ in range(-(-n_tokens // self.bs))]

    def rows(self, table, n):
        k = torch.stack([self.kv[table[p // self.bs], 0, p % self.bs] for p in range(n)]).double()
        v = torch.stack([self.kv[table[p // self.bs], 1, p % self.bs] for p in range(n)]).double()
        return k, v


def _attend(ops, cache, entries, scale, window=0, soft_cap=0.0):
    """entries: (q [n, Hq, D], table, seq_len) per request -> outputs [sum n, Hq, D]."""
    lens = [e[0].shape[0] for e in entries]
    nb = max(len(e[1]) for e in entries)
    bt = torch.zeros(len(entries), nb, dtype=torch.int64)
    for i, e in enumerate(entries):
        bt[i, : len(e[1])] = torch.tensor(e[1])
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
    return ops.attention(torch.cat([e[0] for e in entries]), cache.kv, bt, qsl,
                         torch.tensor([e[2] for e in entries], dtype=torch.int64), scale, window, soft_cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,window,soft_cap", [(4, 2, 64, 0, 0.0), (3, 1, 40, 0, 0.0), (4, 2, 32, 21, 0.0),
                                                     (2, 2, 16, 0, 5.0)])
def test_attention_values_and_split_invariance(ops, dtype, hq, hkv, d, window, soft_cap):
    cache = _Cache(dtype, hkv, d, seed=hq * 100 + d)
    L = 75
    table = cache.table(L)
    q = torch.randn(L, hq, d, generator=cache.g).to(dtype)
    scale = d**-0.5
    full = _attend(ops, cache, [(q, table, L)], scale, window, soft_cap)
    keys, values = cache.rows(table, L)
    err = max((full[p].double() - _reference(q[p], keys, values, p, scale, window, soft_cap)).abs().max().item()
              for p in range(L))
    assert err < TOL[dtype] * 10
    # one decode at a time (K/V of earlier positions "from the cache")
    dec = torch.cat([_attend(ops, cache, [(q[p : p + 1], table, p + 1)], scale, window, soft_cap) for p in range(L)])
    assert torch.equal(dec, full)
    # random chunk splits, each chunk in a batch with random other requests before and after it
    rng = random.Random(d)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, L), rng.randrange(1, 6)))
        outs = []
        for a, b in zip([0] + cuts, cuts + [L]):
            others = []
            for _ in range(rng.randrange(0, 3)):
                n, ctx = rng.choice([1, rng.randrange(2, 30)]), rng.randrange(0, 40)
                others.append((torch.randn(n, hq, d, generator=cache.g).to(dtype), table, ctx + n))
            pos = rng.randrange(0, len(others) + 1)
            entries = others[:pos] + [(q[a:b], table, b)] + others[pos:]
            out = _attend(ops, cache, entries, scale, window, soft_cap)
            start = sum(e[0].shape[0] for e in entries[:pos])
            outs.append(out[start : start + b - a])
        assert torch.equal(torch.cat(outs), full), cuts


def test_attention_same_bits_on_any_thread_count(ops):
    cache = _Cache(torch.float32, 2, 64, seed=7)
    tables = [cache.table(40), cache.table(33)]
    entries = [(torch.randn(1, 4, 64, generator=cache.g), tables[0], 40),
               (torch.randn(33, 4, 64, generator=cache.g), tables[1], 33)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(ops, cache, entries, 0.125)
        torch.set_num_threads(2)
        two = _attend(ops, cache, entries, 0.125)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_attention_errors(ops):
    cache = _Cache(torch.float32, 2, 16, num_blocks=4)
    q = torch.randn(3, 4, 16)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.attention(q.bfloat16(), cache.kv, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 3]),
                      torch.tensor([3]), 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="seq_len"):
        ops.attention(q, cache.kv, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 3]),
                      torch.tensor([2]), 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="too short"):
        ops.attention(q, cache.kv, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 3]),
                      torch.tensor([20]), 0.25, 0, 0.0)


# ------------------------------------------------------------------ act_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,fn", [(0, F.silu), (1, lambda t: F.gelu(t, approximate="tanh")), (2, F.gelu)])
def test_act_mul(ops, dtype, kind, fn):
    g = torch.Generator().manual_seed(kind)
    gu = (torch.randn(37, 2 * 100, generator=g) * 3).to(dtype)
    out = ops.act_mul(gu, kind)
    gate, up = gu.double().chunk(2, -1)
    ref = fn(gate) * up
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.double() - ref).abs() / (1 + ref.abs())).max().item() < tol
    assert torch.equal(ops.act_mul(gu[5:6], kind), out[5:6])
    assert torch.equal(ops.act_mul(gu[3:30], kind), out[3:30])
