"""Rope tables on CPU keep only the half-width cos/sin the in-place C++ rope reads (issue 30.4): the
full ``[n, D]`` tables are built on first use by ``forward``, with values equal to the eager build
they replace, so rotations are bit-identical either way."""
from __future__ import annotations

import pytest
import torch

from pagedllm._custom_ops import cpu_op
from pagedllm.models.layers import RotaryEmbedding


def _reference(n: int, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager table as built before (float32 [n, D]): cat(freqs, freqs).cos/sin x scaling."""
    freqs = torch.arange(n, dtype=torch.float).unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rope(d: int, scaling: float = 1.0) -> RotaryEmbedding:
    return RotaryEmbedding(d, 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d)), scaling)


@pytest.mark.parametrize("d", [64, 256])
def test_cpu_table_keeps_halves_and_builds_full_on_use(d):
    rope = _rope(d, scaling=0.75)
    positions = torch.tensor([0, 5, 1500, 3, 4095], dtype=torch.int64)
    rope._ensure(positions)
    assert rope._rows == 4096 and rope._full is None  # only the halves are held
    ref_cos, ref_sin = _reference(4096, rope.inv_freq, 0.75)
    assert torch.equal(rope._cos_half, ref_cos[:, :d // 2]) and torch.equal(rope._sin_half, ref_sin[:, :d // 2])
    held = rope._cos_half.untyped_storage().nbytes() + rope._sin_half.untyped_storage().nbytes()
    assert held == 2 * 4096 * (d // 2) * 4  # a third of the eager build's (full + halves)
    q = torch.randn(5, 4, d)
    k = torch.randn(5, 2, d)
    qo, ko = rope.forward(positions, q, k)  # the torch path builds the full tables
    assert rope._full is not None and torch.equal(rope._cos, ref_cos) and torch.equal(rope._sin, ref_sin)
    cos, sin = ref_cos[positions].unsqueeze(1), ref_sin[positions].unsqueeze(1)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    assert torch.equal(qo, q * cos + rot(q) * sin) and torch.equal(ko, k * cos + rot(k) * sin)


def test_inplace_rope_without_full_table_matches_forward():
    if cpu_op("rotary_inplace") is None:
        pytest.skip("the C++ CPU kernels are not built")
    d = 128
    rope, ref = _rope(d), _rope(d)
    positions = torch.tensor([7, 0, 2047, 33], dtype=torch.int64)
    q, k = torch.randn(4, 3, d), torch.randn(4, 1, d)
    expect_q, expect_k = ref.forward(positions, q.clone(), k.clone())
    qo, ko = rope.apply_(positions, q, k)
    assert rope._full is None  # the in-place kernel read the halves only
    torch.testing.assert_close(qo, expect_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko, expect_k, rtol=1e-6, atol=1e-6)


def test_drop_table_and_growth():
    rope = _rope(64)
    rope._ensure(torch.tensor([10], dtype=torch.int64))
    assert rope._rows == 1024
    rope._ensure(torch.tensor([5000], dtype=torch.int64))  # grows to the next power of two
    assert rope._rows == 8192 and rope._cos_half.shape == (8192, 32) and rope._full is None
    rope.drop_table()
    assert rope._rows == 0 and rope._cos.shape[0] == 0 and rope._cos_half.shape[0] == 0
    rope.reserve(2000, "cpu")
    assert rope._rows == 2048 and rope._reserved == 2000
    assert torch.equal(rope._cos, _reference(2048, rope.inv_freq, 1.0)[0])
