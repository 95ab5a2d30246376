"""The C++ element-wise CPU kernels (quant_ops.cpp, layer_ops.cpp) against their torch references.

* ``quantize_rows_int8`` / ``rms_norm_quant`` / ``dequant_int32`` / ``dequant_silu_mul_quant`` vs
  the references in ``pagedllm.quantization.w8a8``;
* ``rotary_inplace`` (through ``RotaryEmbedding.apply_``) vs ``RotaryEmbedding.forward``;
* ``reshape_and_cache`` vs the torch path of ``attention.torch_paged.write_kv``;
* ``silu_and_mul`` vs ``silu(gate) * up`` (and GatedMLP's use of it).
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.torch_paged import write_kv
from pagedllm.kernels.cpu_ops import get_ops
from pagedllm.models.layers import RotaryEmbedding
from pagedllm.quantization.w8a8 import (dequant_ref, dequant_silu_mul_quant_ref, quantize_rows_ref,
                                        rms_norm_quant_ref)

ops = get_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ CPU kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_quant_close(q, s, qr, sr, max_frac: float = 1e-3) -> None:
    """q/scale from the kernel vs the reference: scales equal (1e-6 rel.), q off by <= 1 rarely."""
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == qr.shape and s.shape == sr.shape
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    d = (q.int() - qr.int()).abs()
    assert int(d.max()) <= 1
    assert float((d > 0).float().mean()) <= max_frac, int((d > 0).sum())
    assert int(q.abs().max()) <= 127


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[:, None]


# ----------------------------------------------------------------------------- quantize_rows_int8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (64, 1536)])
def test_quantize_rows_matches_reference(dtype, shape):
    g = _gen(shape[0] * 7 + shape[1])
    # rows of very different magnitudes
    x = (torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]).to(dtype)
    q, s = ops.quantize_rows_int8(x)
    qr, sr = quantize_rows_ref(x)
    _assert_quant_close(q, s, qr, sr)
    xf = x.float()
    # every row uses the full range and reconstructs x within half a step
    assert torch.equal(q.abs().amax(-1), torch.full((shape[0],), 127, dtype=torch.int8))
    torch.testing.assert_close(s, xf.abs().amax(-1) / 127, rtol=1e-6, atol=0)
    err = (_deq(q, s) - xf).abs()
    assert bool((err <= s[:, None] * 0.5 * (1 + 1e-4) + 1e-30).all()), float((err / s[:, None]).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_zero_row_and_ties(dtype):
    x = torch.randn(4, 64, generator=_gen(1)).to(dtype)
    x[2] = 0
    q, s = ops.quantize_rows_int8(x)
    assert float(s[2]) == 0.0 and not bool(q[2].any())
    assert bool((s[[0, 1, 3]] > 0).all())
    # exact ties round half to even, as torch.round
    t = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 63.5, -127.0]]).to(dtype)
    q, s = ops.quantize_rows_int8(t)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 64, -127]] and float(s[0]) == 1.0
    assert torch.equal(q, quantize_rows_ref(t)[0])


# ----------------------------------------------------------------------------- rms_norm_quant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 576), (5, 96), (40, 1536)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_matches_reference(dtype, m, k, with_residual):
    g = _gen(m * 31 + k + with_residual)
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    w = torch.rand(k, generator=g) * 2 + 0.1  # float32
    eps = 1e-5
    if with_residual:
        r0 = (torch.randn(m, k, generator=g) * 10).to(dtype)
        r_kernel, r_ref = r0.clone(), r0.clone()
    else:
        r_kernel = r_ref = None
    q, s = ops.rms_norm_quant(x, r_kernel, w, eps)
    qr, sr = rms_norm_quant_ref(x, r_ref, w, eps)
    if with_residual:
        assert torch.equal(r_kernel, x + r0)  # updated in place, rounded to its dtype
        assert torch.equal(r_kernel, r_ref)
    assert q.shape == (m, k) and s.shape == (m,)
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
    diff = (_deq(q, s) - _deq(qr, sr)).abs()
    assert bool((diff <= sr[:, None] * 1.01).all()), float((diff / sr[:, None]).max())
    assert float(((q.int() - qr.int()) != 0).float().mean()) <= 0.01


def test_rms_norm_quant_values_are_the_norm():
    """Beyond matching the reference: q * scale reconstructs rms_norm(x) * w within half a step."""
    g = _gen(5)
    x = torch.randn(3, 256, generator=g)
    w = torch.rand(256, generator=g) + 0.5
    q, s = ops.rms_norm_quant(x, None, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert bool(((_deq(q, s) - want).abs() <= s[:, None] * 0.5 * (1 + 1e-3)).all())


# ----------------------------------------------------------------------------- dequant_int32
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n", [(1, 576), (9, 100), (64, 1536)])
def test_dequant_int32_matches_reference(dtype, rtol, with_bias, m, n):
    g = _gen(m + n + with_bias)
    acc = torch.randint(-200_000, 200_001, (m, n), generator=g, dtype=torch.int32)
    sx = torch.rand(m, generator=g) * 0.05 + 1e-3
    sw = torch.rand(n, generator=g) * 1e-3 + 1e-5
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = ops.dequant_int32(acc, sx, sw, bias, dtype)
    ref = dequant_ref(acc, sx, sw, bias, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-6)
    if ops.int8_gemm_supported():
        # built with AVX512 (implied by VNNI): dequant16 pins the reference's order of operations,
        # so the bits are the same
        assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- dequant_silu_mul_quant
@pytest.mark.parametrize("m,inter", [(1, 1536), (7, 100), (33, 256)])
def test_dequant_silu_mul_quant_matches_reference(m, inter):
    g = _gen(m * 3 + inter)
    acc = torch.randint(-200_000, 200_001, (m, 2 * inter), generator=g, dtype=torch.int32)
    sx = torch.rand(m, generator=g) * 0.02 + 1e-3
    sw = torch.rand(2 * inter, generator=g) * 2e-3 + 1e-5  # gate/up values up to ~+-10 (silu tails too)
    q, s = ops.dequant_silu_mul_quant(acc, sx, sw)
    qr, sr = dequant_silu_mul_quant_ref(acc, sx, sw)
    assert q.dtype == torch.int8 and q.shape == (m, inter) and s.shape == (m,)
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
    diff = (_deq(q, s) - _deq(qr, sr)).abs()
    assert bool((diff <= sr[:, None] * (1 + 1e-5) + 1e-5 * _deq(qr, sr).abs()).all())
    assert float(((q.int() - qr.int()) != 0).float().mean()) <= 0.01


def test_dequant_silu_mul_quant_zero_and_extreme_gates():
    """Rows of zeros give scale 0; large negative gates (exp overflow range) give silu -> 0, not NaN."""
    inter = 64
    acc = torch.zeros(3, 2 * inter, dtype=torch.int32)
    acc[1, :inter] = -2_000_000_000  # gate ~ -2e6 after scaling
    acc[1, inter:] = 1000
    acc[2, :inter] = 2_000_000_000  # gate ~ +2e6: silu(g) = g
    acc[2, inter:] = 1000
    sx = torch.full((3,), 1e-3)
    sw = torch.full((2 * inter,), 1e-3)
    q, s = ops.dequant_silu_mul_quant(acc, sx, sw)
    qr, sr = dequant_silu_mul_quant_ref(acc, sx, sw)
    assert torch.isfinite(s).all()
    assert float(s[0]) == 0.0 and not bool(q[0].any())
    assert float(s[1]) == 0.0 or float(s[1]) < 1e-30
    torch.testing.assert_close(s[2], sr[2], rtol=1e-5, atol=0)
    assert torch.equal(q[2], qr[2])


# ----------------------------------------------------------------------------- rotary_inplace
def _rope(d: int) -> RotaryEmbedding:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    return RotaryEmbedding(d, inv_freq)


def _fused_qk(t: int, hq: int, hkv: int, d: int, dtype, seed: int):
    """(qkv, q, k, v) with q/k/v strided views of one fused projection output, as SelfAttention."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=_gen(seed)).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    return qkv, q.reshape(t, hq, d), k.reshape(t, hkv, d), v


POSITIONS = [5, 3000, 0, 1023, 1024, 17, 2047, 7, 2, 1500, 999, 4095]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (256, 4, 1)])
def test_rotary_inplace_matches_forward(dtype, d, hq, hkv):
    t = len(POSITIONS)
    positions = torch.tensor(POSITIONS, dtype=torch.int64)  # non-monotonic, beyond the 1024 table
    qkv, q, k, v = _fused_qk(t, hq, hkv, d, dtype, seed=d + hq)
    assert not q.is_contiguous() and q.stride(-1) == 1  # a strided view, as in SelfAttention
    q0, k0, v0 = q.clone(), k.clone(), v.clone()

    rope = _rope(d)
    assert rope._cos.shape[0] == 0
    qo, ko = rope.apply_(positions, q, k)  # grows the table itself
    assert qo is q and ko is k  # the same objects, rotated in place
    assert rope._cos.shape[0] >= 4096
    assert not torch.equal(q, q0) and not torch.equal(k, k0)
    assert torch.equal(v, v0)  # the v part of the fused tensor is untouched
    assert qkv.data_ptr() == q.data_ptr()

    ref_q, ref_k = _rope(d).forward(positions, q0, k0)
    if dtype == torch.float32:
        torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    else:
        # forward computes in bf16 (each product rounded); the kernel in float32
        torch.testing.assert_close(q.float(), ref_q.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(k.float(), ref_k.float(), atol=2e-2, rtol=2e-2)
        # against the float32 rope of the same bf16 inputs the kernel is within one bf16 rounding
        fq, fk = _rope(d).forward(positions, q0.float(), k0.float())
        torch.testing.assert_close(q.float(), fq, atol=1e-6, rtol=2 ** -8)
        torch.testing.assert_close(k.float(), fk, atol=1e-6, rtol=2 ** -8)
    # position 0 is the identity
    assert torch.equal(q[2], q0[2]) and torch.equal(k[2], k0[2])


def test_rotary_apply_falls_back_to_forward():
    """int32 positions are not taken by the kernel: apply_ returns forward's new tensors."""
    rope = _rope(64)
    _, q, k, _ = _fused_qk(4, 2, 1, 64, torch.float32, seed=3)
    q0, k0 = q.clone(), k.clone()
    pos32 = torch.tensor([3, 1, 2000, 0], dtype=torch.int32)
    qo, ko = rope.apply_(pos32, q, k)
    assert qo is not q and torch.equal(q, q0) and torch.equal(k, k0)
    rq, rk = _rope(64).forward(pos32.long(), q0, k0)
    torch.testing.assert_close(qo, rq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ko, rk, atol=1e-6, rtol=1e-6)


def test_rotary_inplace_matches_forward_with_scaling():
    d = 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    positions = torch.tensor([9, 1, 1100], dtype=torch.int64)
    _, q, k, _ = _fused_qk(3, 2, 2, d, torch.float32, seed=4)
    q0, k0 = q.clone(), k.clone()
    RotaryEmbedding(d, inv_freq, scaling=1.3).apply_(positions, q, k)
    rq, rk = RotaryEmbedding(d, inv_freq, scaling=1.3).forward(positions, q0, k0)
    torch.testing.assert_close(q, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- reshape_and_cache
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,hkv,d", [(16, 3, 64), (1, 1, 256), (4, 2, 32)])
def test_reshape_and_cache_matches_torch_write_kv(dtype, bs, hkv, d):
    g = _gen(bs * 100 + d)
    nb = 12
    cache0 = torch.randn(nb, 2, bs, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:9]
    slots[[1, 4, 8]] = -1  # padding tokens: skipped
    t = slots.numel()
    hq = 2 * hkv
    fused = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    _, k, v = fused.split([hq * d, hkv * d, hkv * d], -1)
    k, v = k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    assert not k.is_contiguous() and not v.is_contiguous()

    c_ref, c_op, c_direct = cache0.clone(), cache0.clone(), cache0.clone()
    write_kv(c_ref, k, v, slots)  # torch path
    write_kv(c_op, k, v, slots, ops)  # C++ path through the same entry point
    ops.reshape_and_cache(k, v, c_direct, slots)
    assert torch.equal(c_op, c_ref) and torch.equal(c_direct, c_ref)

    # what was written, and nothing else
    written = torch.zeros(nb * bs, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written[s] = True
        assert torch.equal(c_op[s // bs, 0, s % bs], k[i]) and torch.equal(c_op[s // bs, 1, s % bs], v[i])
    untouched = (~written).reshape(nb, bs)
    assert torch.equal(c_op.permute(0, 2, 1, 3, 4)[untouched], cache0.permute(0, 2, 1, 3, 4)[untouched])


def test_reshape_and_cache_all_padding_is_a_no_op():
    cache0 = torch.randn(3, 2, 4, 2, 16)
    c = cache0.clone()
    kv = torch.randn(2, 2, 2, 16)
    ops.reshape_and_cache(kv[0], kv[1], c, torch.full((2,), -1, dtype=torch.int64))
    assert torch.equal(c, cache0)


def test_reshape_and_cache_rejects_out_of_range_slot():
    c = torch.zeros(2, 2, 4, 1, 8)
    k = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot"):
        ops.reshape_and_cache(k, k, c, torch.tensor([8]))


# ----------------------------------------------------------------------------- rms_norm (+ residual)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("m,k", [(1, 576), (7, 100), (70, 640)])
def test_rms_norm_matches_torch_path(dtype, atol, gemma, m, k):
    """``RMSNorm.forward`` through the C++ ``rms_norm`` vs its torch path, with and without the
    residual add; the residual is updated in place to ``x + residual`` in its dtype."""
    from pagedllm.models.layers import RMSNorm

    norm = RMSNorm(k, 1e-5, gemma=gemma).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0 if gemma else 1.0, 0.3, generator=_gen(5))
    x = (torch.randn(m, k, generator=_gen(6)) * 3).to(dtype)
    r = torch.randn(m, k, generator=_gen(7)).to(dtype)
    w = norm.weight.detach().float()
    w = 1.0 + w if gemma else w

    def ref(v):
        vf = v.float()
        return vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    out = ops.rms_norm(x, None, w.contiguous(), 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref(x), atol=atol, rtol=atol)
    via_module = norm(x)
    torch.testing.assert_close(via_module.float(), ref(x), atol=atol, rtol=atol)

    res = r.clone()
    out2, res2 = norm(x, res)
    assert res2 is res  # updated in place
    assert torch.equal(res, (x + r))  # the add is rounded to the dtype like torch's
    torch.testing.assert_close(out2.float(), ref(x + r), atol=atol, rtol=atol)


@pytest.mark.parametrize("m,inter", [(1, 1536), (3, 37), (64, 256)])
def test_silu_and_mul_matches_torch(m, inter):
    """``silu_and_mul(gu)`` = ``silu(gate) * up`` within 1e-6 relative of torch (both ~2e-7 from
    the exact value), with odd widths (the vector loop's tail), extreme gates (exp overflowing both
    ways: silu -> 0 and -> gate) and a non-contiguous input; what GatedMLP.forward computes on CPU."""
    gu = torch.randn(m, 2 * inter, generator=_gen(m)) * 4
    gu[0, :6] = torch.tensor([0.0, -100.0, 100.0, -88.5, 88.5, -1e-30])
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    got = ops.silu_and_mul(gu)
    assert got.shape == (m, inter) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    assert float(got[0, 0]) == 0.0 and abs(float(got[0, 1])) < 1e-30
    assert float(got[0, 2]) == pytest.approx(100.0 * float(gu[0, inter + 2]), rel=1e-6)
    wide = torch.randn(m, 4 * inter, generator=_gen(m + 1))
    torch.testing.assert_close(ops.silu_and_mul(wide[:, ::2]), ops.silu_and_mul(wide[:, ::2].contiguous()),
                               rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_and_mul(gu.half())
    with pytest.raises(RuntimeError, match="2I"):
        ops.silu_and_mul(torch.randn(2, 5))


def test_silu_and_mul_bfloat16_matches_torch():
    """bfloat16 ``gu``: torch's two roundings (silu(gate) to bfloat16, then the product with up), so
    over every bfloat16 gate in [-80, 100] (silu a normal float32) the result equals
    ``F.silu(gate) * up`` on bfloat16 tensors except for gates whose exact silu lies within 1e-6
    relative of the midpoint between two bfloat16 values (the kernel's and torch's float32 exps
    differ by ~2e-7 there): at most 0.1% of the gates, each then the other neighbour (checked with
    up = 1; with random ups only the fraction). Gates of -100 / 100 give ~0 / the gate."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = bits[torch.isfinite(bits) & (bits.float() >= -80) & (bits.float() <= 100)]
    for up in (torch.randn(gate.shape, generator=_gen(1)).bfloat16(), torch.ones_like(gate)):
        got = ops.silu_and_mul(torch.cat([gate, up]).reshape(1, -1))[0]
        assert got.dtype == torch.bfloat16 and got.shape == gate.shape
        want = torch.nn.functional.silu(gate) * up
        diff = got != want
        assert float(diff.float().mean()) <= 1e-3, int(diff.sum())
    # up = 1 (the last pass): each differing gate's exact silu sits at the midpoint of torch's and ours
    exact = torch.nn.functional.silu(gate[diff].double())
    mid = (got[diff].double() + want[diff].double()) / 2
    assert bool(((exact - mid).abs() <= 1e-6 * exact.abs()).all())
    ends = ops.silu_and_mul(torch.tensor([[-100.0, 100.0, 3.0, 2.0]], dtype=torch.bfloat16))[0]
    assert abs(float(ends[0])) < 1e-30 and float(ends[1]) == 200.0


def test_gated_mlp_uses_silu_and_mul_on_cpu_float32():
    """GatedMLP (SiLU) on CPU float32 and bfloat16 takes the kernel and agrees with the torch
    formula."""
    from pagedllm.models.layers import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, "silu")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 32)
    gate, up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    want = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, mlp.down_proj.weight)
    with torch.inference_mode():
        got = mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    gu = mlp.gate_up_proj(x)
    assert torch.equal(got, mlp.down_proj(ops.silu_and_mul(gu)))
    mlp16 = GatedMLP(32, 48, "silu").bfloat16()
    mlp16.load_state_dict({k: v.bfloat16() for k, v in mlp.state_dict().items()})
    with torch.inference_mode():
        got16 = mlp16(x.bfloat16())
        gu16 = mlp16.gate_up_proj(x.bfloat16())
        assert torch.equal(got16, mlp16.down_proj(ops.silu_and_mul(gu16)))
    torch.testing.assert_close(got16.float(), want, rtol=5e-2, atol=5e-2)
