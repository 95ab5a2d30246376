"""TorchPagedAttention vs a dense per-request reference computed from the raw K/V."""
import math

import pytest
import torch

from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

torch.set_num_threads(1)


def dense_reference(q, k, v, start, scale, window, cap):
    """q [Lq, Hq, D] at positions start..; k, v [start + Lq, Hkv, D] (all positions) -> [Lq, Hq, D] fp32."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None]
    ok = kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


def run_case(block_size, hq, hkv, window, cap, reqs_spec, dtype=torch.float32, seed=0):
    """reqs_spec: list of (start_pos, num_new). Fills earlier context through the backend first."""
    g = torch.Generator().manual_seed(seed)
    d = 16
    num_blocks = sum(math.ceil((s + n) / block_size) for s, n in reqs_spec) + 3
    cache = torch.zeros(num_blocks, 2, block_size, hkv, d, dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()  # scattered, non-contiguous blocks
    reqs, full_k, full_v, full_q = [], [], [], []
    for s, n in reqs_spec:
        nb = math.ceil((s + n) / block_size)
        blocks, perm = perm[:nb], perm[nb:]
        reqs.append((s, n, blocks))
        full_k.append(torch.randn(s + n, hkv, d, generator=g).to(dtype))
        full_v.append(torch.randn(s + n, hkv, d, generator=g).to(dtype))
        full_q.append(torch.randn(s + n, hq, d, generator=g).to(dtype))
    impl, scale = TorchPagedAttention(), d**-0.5
    # Earlier context: written by a prior step of prefills (order must be: decodes first, so use
    # all-prefill lists; a 1-token context becomes a decode there).
    idx = sorted((i for i, r in enumerate(reqs) if r[0] > 0), key=lambda i: reqs[i][0] != 1)
    if idx:
        meta = build_metadata([(0, reqs[i][0], reqs[i][2]) for i in idx], block_size)
        ctx = lambda xs: torch.cat([xs[i][: reqs[i][0]] for i in idx])
        impl.forward(ctx(full_q), ctx(full_k), ctx(full_v), cache, meta, scale, window, cap)
    meta = build_metadata(reqs, block_size)
    new = lambda xs: torch.cat([x[s : s + n] for (s, n, _), x in zip(reqs, xs)])
    out = impl.forward(new(full_q), new(full_k), new(full_v), cache, meta, scale, window, cap)
    assert out.dtype == dtype and out.shape == new(full_q).shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    off = 0
    for (s, n, _), q, k, v in zip(reqs, full_q, full_k, full_v):
        ref = dense_reference(q[s : s + n], k, v, s, scale, window, cap)
        torch.testing.assert_close(out[off : off + n].float(), ref, atol=tol, rtol=tol)
        off += n
    return cache, meta, new(full_k), new(full_v)


MIXED = [(5, 1), (0, 1), (17, 1), (0, 7), (9, 6), (3, 13)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_mixed_batch_matches_dense(block_size, hq, hkv):
    run_case(block_size, hq, hkv, None, None, MIXED)


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_sliding_window_and_soft_cap(window, cap):
    run_case(4, 4, 2, window, cap, MIXED + [(20, 3)], seed=window)


def test_soft_cap_no_window():
    run_case(4, 4, 1, None, 2.0, MIXED)


def test_decode_only_and_prefill_only():
    run_case(4, 4, 2, None, None, [(3, 1), (10, 1)])
    run_case(4, 4, 2, 5, None, [(0, 9), (4, 4)])


def test_bf16():
    run_case(4, 4, 2, 6, None, MIXED, dtype=torch.bfloat16)


def test_kv_written_to_slots_and_padding_skipped():
    bs, hkv, d = 4, 2, 8
    cache = torch.zeros(6, 2, bs, hkv, d)
    meta = build_metadata([(0, 6, [3, 1])], bs)
    meta.slot_mapping[2] = -1  # pretend token 2 is padding
    k, v = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    TorchPagedAttention().forward(torch.randn(6, hkv, d), k, v, cache, meta, 1.0, None, None)
    expect = {0: (3, 0), 1: (3, 1), 3: (3, 3), 4: (1, 0), 5: (1, 1)}
    for t, (b, o) in expect.items():
        assert torch.equal(cache[b, 0, o], k[t]) and torch.equal(cache[b, 1, o], v[t])
    assert torch.count_nonzero(cache[3, :, 2]) == 0  # skipped slot untouched
    assert torch.count_nonzero(cache[[0, 2, 4, 5]]) == 0


def test_build_metadata():
    m = build_metadata([(4, 1, [2, 0]), (0, 3, [1])], 4)
    assert m.num_decodes == 1 and m.query_lens == [1, 3] and m.seq_lens_list == [5, 3]
    assert m.slot_mapping.tolist() == [0, 4, 5, 6]
    assert m.query_start_loc.tolist() == [0, 1, 4]
    assert m.block_tables.tolist() == [[2, 0], [1, 0]]
    with pytest.raises(ValueError):
        build_metadata([(0, 3, [1]), (4, 1, [2, 0])], 4)


def test_request_reads_block_written_by_another_in_same_step():
    """B's cached prefix block is filled by A in the same step (writes happen before attention)."""
    bs, h, d = 4, 2, 8
    g = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(7, h, d, generator=g) for _ in range(3))
    cache = torch.zeros(5, 2, bs, h, d)
    meta = build_metadata([(0, 6, [2, 0]), (4, 3, [2, 4])], bs)  # both use block 2 for tokens 0..3
    kb, vb, qb = k, v, q  # A computes tokens 0..5, B (same prefix) computes 4..6
    tk, tv, tq = (torch.cat([x[:6], x[4:7]]) for x in (kb, vb, qb))
    out = TorchPagedAttention().forward(tq, tk, tv, cache, meta, d**-0.5, None, None)
    torch.testing.assert_close(out[6:], dense_reference(qb[4:7], kb, vb, 4, d**-0.5, None, None))
    torch.testing.assert_close(out[:6], dense_reference(qb[:6], kb[:6], vb[:6], 0, d**-0.5, None, None))


@pytest.mark.parametrize("window, soft_cap", [(None, None), (96, None), (None, 30.0)])
def test_masked_prefill_in_query_blocks_is_bit_identical(monkeypatch, window, soft_cap):
    """A masked prefill chunk runs in blocks of PREFILL_Q_BLOCK query rows (issue 30.4: the mask and
    the soft-cap scores stay PREFILL_Q_BLOCK x context): the same bits as one call over all rows."""
    import pagedllm.attention.torch_paged as tp

    g = torch.Generator().manual_seed(3)
    lq, lk = 600, 1400
    q, kc, vc = (torch.randn(*s, generator=g) for s in ((lq, 6, 32), (2, lk, 32), (2, lk, 32)))
    monkeypatch.setattr(tp, "PREFILL_Q_BLOCK", 1 << 30)
    whole = tp.TorchPagedAttention._prefill(q, kc, vc, lk - lq, 0.17, window, soft_cap)
    monkeypatch.setattr(tp, "PREFILL_Q_BLOCK", 128)
    blocks = tp.TorchPagedAttention._prefill(q, kc, vc, lk - lq, 0.17, window, soft_cap)
    assert torch.equal(blocks, whole)


def test_masked_prefill_workspace_is_bounded_by_the_query_block():
    """With the caching CPU allocator (it keeps freed blocks of >= 1 MiB, so after a call it holds
    the call's large temporaries): a 2,048-row chunk over 8,192 keys needs masks (SDPA) or float32
    scores (soft-cap) for PREFILL_Q_BLOCK rows at a time, not for 2,048 (here: 10 and 100 MiB
    instead of 82 and 804 MiB)."""
    import pagedllm.attention.torch_paged as tp
    from pagedllm.kernels.cpu_ops import cpu_allocator_empty_cache, cpu_allocator_stats, install_cpu_allocator

    if not install_cpu_allocator() or not cpu_allocator_stats():
        pytest.skip("the caching CPU allocator is not installed")
    lq, lk, hq, hkv, d = 2048, 8192, 4, 1, 64
    q, kc, vc = torch.randn(lq, hq, d), torch.randn(hkv, lk, d), torch.randn(hkv, lk, d)
    io = 4 * lq * hq * d * 4 + (4 << 20)  # q, outputs, blocks' outputs before the cat
    rows = tp.PREFILL_Q_BLOCK
    for soft_cap, per_row_key in ((None, 2 * 5), (50.0, 6 * hq * 4)):  # bool + float mask; scores + probs
        cpu_allocator_empty_cache()
        out = tp.TorchPagedAttention._prefill(q, kc, vc, lk - lq, 0.125, None, soft_cap)
        assert out.shape == (lq, hq, d)
        del out
        used = cpu_allocator_stats()["cached_bytes"]
        bound = rows * lk * per_row_key + io
        assert used <= bound, (soft_cap, used, bound)
        assert bound < lq * lk * per_row_key / 2  # one call over all rows would need more
