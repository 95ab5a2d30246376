"""The integer-dot GEMM (``csrc/intdot_gemm.cpp``) on the group layout's int4 / int8 kinds with
groups of 32 (GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 / Q5_0 / Q5_1 / Q5_K), at every M.

Stated bounds:
* activation quantization (per 32-block int8, llama.cpp Q8_1-style scale and scaled code sum):
  codes and scales equal (``torch.equal``) to the torch reference ``_quantize_ref`` on every ISA
  path.
* each ISA path (portable, AVX2, AVX512-VNNI; paths the CPU lacks are skipped naming the flag)
  and both kernels (columns: M < 4, rows: M >= 4, each forced at every M) bit-identical
  (``torch.equal``) to ``_fixed_ref``, the file comment's float arithmetic emulated in torch
  (exact int64 block dots, float32 scale products, each fma as one rounding of the exact float64
  value), and against ``_intdot_ref`` (exact integers, float64 scales) max abs error <= 1e-5 *
  (sum |terms| + 1) per output.
* against float64 ``F.linear`` on the dequantized weight: relative L2 error < 2e-2 (int8
  activations: llama.cpp's own trade; measured ~5e-3 on random data).
* M-invariance: each row's output bit-identical whether computed alone or inside a batch of
  M = 1..16 and 17..70 (any position), and for any thread count.
* ``PAGEDLLM_ISA`` forces a path (``group_quant.intdot_isa``) and refuses unknown names.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import pagedllm.kernels.cpu_ops as cpu_ops
from pagedllm.quantization import group_quant as gq

torch.set_num_threads(1)

OPS = cpu_ops.get_intdot_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="integer-dot C++ kernel not built here")

ISAS = {0: ("portable", None), 1: ("avx2", "avx2 + fma"), 2: ("avx512vnni", "avx512f/bw/vl + avx512_vnni")}


def _require(isa: int) -> None:
    if not OPS.intdot_isa_supported(isa):
        pytest.skip(f"CPU lacks {ISAS[isa][1]} (ISA path {ISAS[isa][0]})")


def _quantize_ref(x: torch.Tensor):
    """x [M, K] -> (a int8 [M, K], xd f32 [M, K/32], xs f32 [M, K/32]) in float32 torch ops:
    xd = amax / 127, a = round_half_even(x * (1 / xd)), xs = xd * sum(a) (llama.cpp Q8_1's d, qs, s)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    a = torch.round(xb * inv.unsqueeze(-1))
    xs = d * a.sum(-1)
    return a.to(torch.int8).reshape(m, k), d, xs


def _intdot_ref(x, qweight, scales, mins, bias, kind, group):
    """float64 [M, N]: sum_b d[n,g] xd[r,b] sum_k q a (int64) + sum_b m[n,g] xs[r,b] + bias; also
    the sum of the terms' magnitudes (for the error bound)."""
    a, xd, xs = _quantize_ref(x)
    m, k = a.shape
    nb = k // 32
    q = (gq.unpack_int4(qweight) if kind == gq.KIND_INT4 else qweight).to(torch.int64)
    n = q.shape[0]
    g = torch.arange(nb) * 32 // group
    isum = torch.einsum("rbk,nbk->rnb", a.to(torch.int64).reshape(m, nb, 32), q.reshape(n, nb, 32))
    terms = isum.double() * scales[:, g].double().unsqueeze(0) * xd.double().unsqueeze(1)
    if mins is not None:
        terms = torch.cat([terms, mins[:, g].double().unsqueeze(0) * xs.double().unsqueeze(1)], -1)
    y = terms.sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y, terms.abs().sum(-1)


def _fixed_ref(x, qweight, scales, mins, bias, kind):
    """float32 [M, N]: the kernel's fixed arithmetic (group 32): acc = fma(float(i_b), d_b * xd_b, acc)
    over b in order, macc = fma(m_b, xs_b, macc), y = (acc + macc) + bias; each fma rounds the exact
    float64 value once to float32 (products of a < 2^20 integer and a float32 are exact in float64)."""
    a, xd, xs = _quantize_ref(x)
    m, k = a.shape
    nb = k // 32
    q = (gq.unpack_int4(qweight) if kind == gq.KIND_INT4 else qweight).to(torch.int64)
    isum = torch.einsum("rbk,nbk->rnb", a.to(torch.int64).reshape(m, nb, 32), q.reshape(q.shape[0], nb, 32))
    acc = torch.zeros(m, q.shape[0], dtype=torch.float32)
    macc = torch.zeros_like(acc)
    for b in range(nb):
        s = scales[:, b].unsqueeze(0) * xd[:, b].unsqueeze(1)  # float32 product, [M, N]
        acc = (isum[:, :, b].double() * s.double() + acc.double()).float()
        if mins is not None:
            macc = (mins[:, b].double().unsqueeze(0) * xs[:, b].double().unsqueeze(1) + macc.double()).float()
    y = acc + macc if mins is not None else acc
    return y + bias.float() if bias is not None else y


def _weight(kind: int, n: int, k: int, group: int = 32, with_mins: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == gq.KIND_INT4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        q = gq.pack_int4(codes)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ng = -(-k // group)
    scales = (torch.rand(n, ng, generator=g) + 0.1) * 0.01
    mins = -(torch.rand(n, ng, generator=g)) * 0.08 if with_mins else None
    return q.contiguous(), scales.contiguous(), None if mins is None else mins.contiguous()


CASES = [(gq.KIND_INT4, True), (gq.KIND_INT4, False), (gq.KIND_INT8, False), (gq.KIND_INT8, True)]


@pytest.mark.parametrize("isa", [0, 1, 2])
def test_quantize_matches_reference(isa):
    _require(isa)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=g) * torch.linspace(0.01, 10, 256)
    x[2, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[3, :8] = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, 127.0, -127.0, 0.0])  # ties at scale 1: half to even
    a, xd, xs = OPS.intdot_quantize(x, isa)
    ra, rxd, rxs = _quantize_ref(x)
    assert torch.equal(a, ra) and torch.equal(xd, rxd) and torch.equal(xs, rxs)
    assert int(a.abs().max()) <= 127
    # bfloat16 input quantizes its float32 value
    ab, _, _ = OPS.intdot_quantize(x.bfloat16(), isa)
    assert torch.equal(ab, _quantize_ref(x.bfloat16().float())[0])


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_matches_same_arithmetic_reference(isa, kind, with_mins, m):
    _require(isa)
    n, k = 37, 320  # odd N, K = 10 blocks
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=m)
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g) * 0.1
    y = OPS.intdot_gemm(x, q, scales, mins, bias, kind, 32, torch.float32, isa)
    ref, mag = _intdot_ref(x, q, scales, mins, bias, kind, 32)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert bool(((y.double() - ref).abs() <= 1e-5 * (mag + 1)).all()), float((y.double() - ref).abs().max())
    # and within the format's tolerance of float math on the dequantized weight
    w = gq.dequantize(q, scales, mins, kind, 32, k)
    lin = F.linear(x.double(), w.double(), bias.double())
    assert float((y.double() - lin).norm() / lin.norm()) < 2e-2
    # bfloat16 activations / outputs
    yb = OPS.intdot_gemm(x.bfloat16(), q, scales, mins, None, kind, 32, torch.bfloat16, isa)
    refb, _ = _intdot_ref(x.bfloat16().float(), q, scales, mins, None, kind, 32)
    assert yb.dtype == torch.bfloat16 and float((yb.double() - refb).norm() / refb.norm()) < 1e-2


@pytest.mark.parametrize("kind,with_mins", CASES)
def test_isa_paths_bit_identical(kind, with_mins):
    have = [i for i in ISAS if OPS.intdot_isa_supported(i)]
    if len(have) < 2:
        pytest.skip("only the portable path runs on this CPU")
    n, k = 51, 576
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=7)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(8))
    outs = [OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.float32, i) for i in have]
    for i, o in zip(have[1:], outs[1:]):
        assert torch.equal(o, outs[0]), (ISAS[have[0]][0], ISAS[i][0])


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES[:3])
def test_rows_independent_of_batch(isa, kind, with_mins):
    """A row's result is bit-identical alone and at any position of a batch of 1..16 rows."""
    _require(isa)
    n, k = 65, 192
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=3)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([OPS.intdot_gemm(x[r:r + 1], q, scales, mins, None, kind, 32, torch.float32, isa)
                       for r in range(16)])
    for m in range(1, 17):
        for start in sorted({0, 16 - m, (16 - m) // 2}):
            y = OPS.intdot_gemm(x[start:start + m], q, scales, mins, None, kind, 32, torch.float32, isa)
            assert torch.equal(y, alone[start:start + m]), (m, start)


@pytest.mark.parametrize("m", [3, 40])
def test_thread_count_does_not_change_results(m):
    kind = gq.KIND_INT4
    n, k = 4099, 64  # many tasks
    q, scales, mins = _weight(kind, n, k, seed=11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.float32)
        torch.set_num_threads(2)
        y2 = OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.float32)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(y1, y2)


def test_wider_groups_and_errors():
    """group 64 (two 32-blocks share a scale), and the shapes it refuses."""
    n, k = 9, 128
    q, scales, mins = _weight(gq.KIND_INT4, n, k, group=64, seed=2)
    x = torch.randn(2, k)
    y = OPS.intdot_gemm(x, q, scales, mins, None, gq.KIND_INT4, 64, torch.float32)
    ref, mag = _intdot_ref(x, q, scales, mins, None, gq.KIND_INT4, 64)
    assert bool(((y.double() - ref).abs() <= 1e-5 * (mag + 1)).all())
    with pytest.raises(RuntimeError):
        OPS.intdot_gemm(x, q, scales, mins, None, gq.KIND_INT4, 16, torch.float32)
    with pytest.raises(RuntimeError):
        OPS.intdot_gemm(torch.randn(2, 100), q, scales, mins, None, gq.KIND_INT4, 64, torch.float32)
    with pytest.raises(RuntimeError):
        OPS.intdot_gemm(x, q, scales, mins, None, 2, 64, torch.float32)
    assert OPS.intdot_gemm(x[:0], q, scales, mins, None, gq.KIND_INT4, 64, torch.float32).shape == (0, n)
    assert OPS.intdot_isa_name(OPS.intdot_best_isa()) in ("portable", "avx2", "avx512vnni")


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
def test_prefill_sized_rows_match_single_row_calls(isa, kind, with_mins):
    """M > 16 (the prefill order: column panels x row tiles of 8 / 4, activations packed per tile)
    gives every row bit-identical to its M = 1 call, at any position; N = 400 with K = 1024 spans
    two or three column panels (~192 KB of codes + scales each) and odd row tails."""
    _require(isa)
    n, k = 400, 1024
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(70, k, generator=g) * torch.linspace(0.1, 3, k)
    bias = torch.randn(n, generator=g) * 0.1
    alone = torch.cat([OPS.intdot_gemm(x[r:r + 1], q, scales, mins, bias, kind, 32, torch.float32, isa)
                       for r in range(70)])
    for m, start in [(17, 0), (23, 5), (37, 33), (64, 3), (70, 0)]:
        y = OPS.intdot_gemm(x[start:start + m], q, scales, mins, bias, kind, 32, torch.float32, isa)
        assert torch.equal(y, alone[start:start + m]), (m, start)
    ref, mag = _intdot_ref(x, q, scales, mins, bias, kind, 32)
    assert bool(((alone.double() - ref).abs() <= 1e-5 * (mag + 1)).all())


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
def test_bfloat16_input_equals_its_float32_value(isa, kind, with_mins):
    """bfloat16 activations (quantized straight into the rows kernel's tiles, no float copy) give
    the bits of the same values passed as float32, on both kernels and both output dtypes, at M =
    1, 3 (columns kernel) and 4, 9, 16, 41 (rows kernel: one, two and an odd count of 8-row tiles)."""
    _require(isa)
    n, k = 70, 320
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=41)
    g = torch.Generator().manual_seed(42)
    for m in (1, 3, 4, 9, 16, 41):
        xb = (torch.randn(m, k, generator=g) * torch.linspace(0.05, 4, k)).bfloat16()
        for out in (torch.float32, torch.bfloat16):
            yb = OPS.intdot_gemm(xb, q, scales, mins, None, kind, 32, out, isa)
            yf = OPS.intdot_gemm(xb.float(), q, scales, mins, None, kind, 32, out, isa)
            assert yb.dtype == out and torch.equal(yb, yf), (m, out)


@pytest.mark.parametrize("kind,with_mins", CASES)
def test_isa_paths_bit_identical_prefill_sized(kind, with_mins):
    have = [i for i in ISAS if OPS.intdot_isa_supported(i)]
    if len(have) < 2:
        pytest.skip("only the portable path runs on this CPU")
    n, k = 300, 1024
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=9)
    x = torch.randn(45, k, generator=torch.Generator().manual_seed(10))
    outs = [OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.float32, i) for i in have]
    for i, o in zip(have[1:], outs[1:]):
        assert torch.equal(o, outs[0]), (ISAS[have[0]][0], ISAS[i][0])


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
def test_both_kernels_equal_the_fixed_arithmetic(isa, kind, with_mins):
    """Columns kernel (forced at every M), rows kernel (forced from M = 1) and the default choice all
    give exactly ``_fixed_ref``'s bits, at M = 1..9 and 33 (tiles of 8 with tails)."""
    _require(isa)
    n, k = 45, 352  # N not a multiple of 8 or 4; 11 blocks (not a multiple of 8: the scale transposes' tail)
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=31)
    g = torch.Generator().manual_seed(32)
    bias = torch.randn(n, generator=g) * 0.1
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33):
        x = torch.randn(m, k, generator=g) * torch.linspace(0.05, 4, k)
        want = _fixed_ref(x, q, scales, mins, bias, kind)
        for rows_min_m in (0, 1, 1 << 20):
            y = OPS.intdot_gemm(x, q, scales, mins, bias, kind, 32, torch.float32, isa, rows_min_m)
            assert torch.equal(y, want), (m, rows_min_m)
    assert OPS.intdot_rows_min_m() == 8


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind", [gq.KIND_INT4, gq.KIND_INT8])
def test_extreme_codes_exact(isa, kind):
    """Weight codes at their extremes (int4 15, int8 -128 / 127) against activations at +-127 in
    every lane: the integer bounds the kernels rely on (vpmaddubsw pair sums below 2^15, int8 as
    q + 128 on VNNI) hold, so both kernels give ``_fixed_ref``'s bits at M = 1..8 and 12 on K = 224
    (7 blocks: an odd block count, the int4 block-pair tail)."""
    _require(isa)
    n, k = 19, 224
    g = torch.Generator().manual_seed(51)
    if kind == gq.KIND_INT4:
        q = gq.pack_int4(torch.full((n, k), 15, dtype=torch.uint8)).contiguous()
    else:
        q = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8).contiguous()
    scales = (torch.rand(n, k // 32, generator=g) + 0.5).contiguous()
    mins = -torch.rand(n, k // 32, generator=g).contiguous()
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 12):
        sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
        x = sign * 3.0  # every code +-127 (amax / 127 scale)
        if m > 1:
            x[1] = 3.0  # a row of +127 only
        want = _fixed_ref(x, q, scales, mins, None, kind)
        for rows_min_m in (0, 1, 1 << 20):
            y = OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.float32, isa, rows_min_m)
            assert torch.equal(y, want), (m, rows_min_m)


def test_isa_env_knob(monkeypatch):
    """PAGEDLLM_ISA forces the ISA path the engine's GGUF linears take; unknown or unsupported names raise."""
    monkeypatch.setattr(gq, "INTDOT", True)
    for name, isa in gq.ISA_PATHS.items():
        monkeypatch.setattr(gq, "_intdot_isa", None)
        monkeypatch.setenv("PAGEDLLM_ISA", name)
        if not OPS.intdot_isa_supported(isa):
            with pytest.raises(ValueError, match="lacks"):
                gq.intdot_isa(OPS)
            continue
        assert gq.intdot_isa(OPS) == isa and gq.intdot_path() == name
    monkeypatch.setattr(gq, "_intdot_isa", None)
    monkeypatch.setenv("PAGEDLLM_ISA", "sse9")
    with pytest.raises(ValueError, match="PAGEDLLM_ISA"):
        gq.intdot_isa(OPS)
    monkeypatch.setattr(gq, "_intdot_isa", None)
    monkeypatch.setenv("PAGEDLLM_ISA", "auto")
    assert gq.intdot_isa(OPS) == OPS.intdot_best_isa()
    monkeypatch.setattr(gq, "_intdot_isa", None)


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
def test_float16_scales_bit_identical_to_float32(isa, kind, with_mins):
    """float16 scales / mins (GGUF Q4_0 / Q4_1 / Q5_x / Q8_0 keep the file's fields) give the same
    bits as the same values in float32, on both kernels (columns and rows forced), with a bias,
    float32 and bfloat16 inputs, a block count with a transpose tail (11) and ragged N; and group
    64 (expanded scales). Mixed dtypes are refused."""
    _require(isa)
    n, k = 29, 32 * 11
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=11)
    sh, mh = scales.half(), None if mins is None else mins.half()
    sf, mf = sh.float(), None if mh is None else mh.float()
    bias = torch.randn(n)
    for m in (1, 3, 8, 19):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for rows_min_m in (1, 1 << 20):
            want = OPS.intdot_gemm(x, q, sf, mf, bias, kind, 32, torch.float32, isa, rows_min_m)
            got = OPS.intdot_gemm(x, q, sh, mh, bias, kind, 32, torch.float32, isa, rows_min_m)
            assert torch.equal(got, want), (m, rows_min_m)
            wb = OPS.intdot_gemm(x.bfloat16(), q, sf, mf, None, kind, 32, torch.bfloat16, isa, rows_min_m)
            gb = OPS.intdot_gemm(x.bfloat16(), q, sh, mh, None, kind, 32, torch.bfloat16, isa, rows_min_m)
            assert torch.equal(gb, wb), (m, rows_min_m)
    q64, s64, m64 = _weight(kind, n, 128, group=64, with_mins=with_mins, seed=12)
    x = torch.randn(9, 128)
    for rows_min_m in (1, 1 << 20):
        want = OPS.intdot_gemm(x, q64, s64.half().float(), None if m64 is None else m64.half().float(), None, kind,
                               64, torch.float32, isa, rows_min_m)
        got = OPS.intdot_gemm(x, q64, s64.half(), None if m64 is None else m64.half(), None, kind, 64,
                              torch.float32, isa, rows_min_m)
        assert torch.equal(got, want)
    if with_mins:
        with pytest.raises(RuntimeError, match="mins"):
            OPS.intdot_gemm(torch.randn(2, k), q, sh, mf, None, kind, 32, torch.float32, isa)


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
def test_interleaved_scales_bit_identical(isa, kind, with_mins):
    """The columns kernel reading the interleaved float16 scales (``group_quant.interleave_scales``,
    ``smt``) in place of transposing them gives the bits of the plain call, at every M up to the rows
    kernel's (which ignores them), ragged N (a last group of 8 columns with 5 valid), block counts
    with and without a transpose tail, 1 and 2 threads; a wrong shape or dtype is refused."""
    _require(isa)
    for n, k in ((29, 32 * 11), (16, 32 * 3), (48, 32 * 18)):
        q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=n)
        sh, mh = scales.half(), None if mins is None else mins.half()
        smt = gq.interleave_scales(sh, mh)
        assert smt.shape == (-(-n // 8), k // 32, 16 if with_mins else 8) and smt.dtype == torch.float16
        assert torch.equal(smt[1, 2, :8], sh[8:16, 2])
        if with_mins:
            assert torch.equal(smt[0, 1, 8:], mh[:8, 1])
        bias = torch.randn(n)
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for m in (1, 2, 3, 4, 5, 7, 9):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    want = OPS.intdot_gemm(x, q, sh, mh, bias, kind, 32, torch.float32, isa)
                    got = OPS.intdot_gemm(x, q, sh, mh, bias, kind, 32, torch.float32, isa, 0, smt)
                    assert torch.equal(got, want), (n, k, m, threads)
                    gb = OPS.intdot_gemm(x.bfloat16(), q, sh, mh, None, kind, 32, torch.bfloat16, isa, 0, smt)
                    assert torch.equal(gb, OPS.intdot_gemm(x.bfloat16(), q, sh, mh, None, kind, 32, torch.bfloat16,
                                                           isa)), (n, k, m, threads)
        finally:
            torch.set_num_threads(1)
    x = torch.randn(1, k)
    with pytest.raises(RuntimeError, match="interleaved"):
        OPS.intdot_gemm(x, q, sh, mh, None, kind, 32, torch.float32, isa, 0, smt[:, :, :4].contiguous())
    with pytest.raises(RuntimeError, match="interleaved"):
        OPS.intdot_gemm(x, q, sh.float(), None if mh is None else mh.float(), None, kind, 32, torch.float32, isa, 0,
                        smt)


def test_install_adds_interleaved_scales_for_gguf_layouts():
    """``group_quant.install`` keeps the interleaved copy for float16 32-group scales on x86-64
    (GGUF's layouts), none for float32 or wider groups (GPTQ / AWQ layouts); ``group_linear`` gives
    the same bits with and without it."""
    from torch import nn

    n, k = 40, 64
    q, scales, mins = _weight(gq.KIND_INT4, n, k, seed=3)
    codes = gq.unpack_int4(q)
    half = nn.Linear(k, n, bias=False)
    gq.install(half, gq.GroupWeight(codes, scales.half(), mins.half(), gq.KIND_INT4, 32))
    full = nn.Linear(k, n, bias=False)
    gq.install(full, gq.GroupWeight(codes, scales, mins, gq.KIND_INT4, 32))
    assert full.scales_il is None
    if not gq.interleave_wanted():
        assert half.scales_il is None
        return
    assert torch.equal(half.scales_il, gq.interleave_scales(half.scales, half.mins))
    x = torch.randn(3, k)
    y = gq.group_linear(half, x, None, intdot=True)
    half.scales_il = None
    assert torch.equal(gq.group_linear(half, x, None, intdot=True), y)


@pytest.mark.parametrize("kind,with_mins", CASES)
def test_group_gemm_float16_scales_bit_identical(kind, with_mins):
    """group_gemm / group_dequantize (the float-activation kernel) take float16 scales / mins with
    the bits of their float32 values, at the register (M <= large_m) and tiled (M > large_m) sizes."""
    ops = cpu_ops.get_quant_ops()
    if ops is None:
        pytest.skip("group GEMM C++ kernel not built here")
    n, k = 21, 256
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=13)
    sh, mh = scales.half(), None if mins is None else mins.half()
    sf, mf = sh.float(), None if mh is None else mh.float()
    for m in (1, 5, 40):
        x = torch.randn(m, k)
        want = ops.group_gemm(x, q, sf, mf, None, kind, 32, gq.LARGE_M, torch.float32)
        assert torch.equal(ops.group_gemm(x, q, sh, mh, None, kind, 32, gq.LARGE_M, torch.float32), want), m
    assert torch.equal(ops.group_dequantize(q, sh, mh, kind, 32, k, 3, 17, torch.float32),
                       ops.group_dequantize(q, sf, mf, kind, 32, k, 3, 17, torch.float32))
    assert torch.equal(gq.dequantize(q, sh, mh, kind, 32, k), gq.dequantize(q, sf, mf, kind, 32, k))


@pytest.mark.skipif(OPS is None or shutil.which("objdump") is None,
                    reason="needs the integer-dot kernel and binutils' objdump")
def test_columns_kernels_keep_their_prefetches():
    """The columns kernel (decode, verify) of both x86 paths prefetches a later column group's codes
    into L2 (`GroupPrefetch`, intdot_gemm.cpp). Out of line, GCC 12's IPA mod/ref analysis deleted
    that helper and every call to it (a function of prefetches only "has no effect"): no output
    changes, only decode speed (the LM head 1.7x slower on Zen 1). Checked in the built object, per
    ISA path and <int4, mins> instantiation (in cols_range or the cols8 it calls)."""
    dis = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", OPS.__file__], check=True,
                         capture_output=True, text=True).stdout
    keys = [(ns, i4, mins) for ns in ("avx2", "vnni") for i4 in ("true", "false") for mins in ("true", "false")]
    per_key = {k: 0 for k in keys}
    seen = set()
    fn_keys: list = []
    for line in dis.splitlines():
        if line.endswith(">:"):
            fn_keys = [k for k in keys if f"id_{k[0]}::cols_range<{k[1]}, {k[2]}>" in line
                       or f"id_{k[0]}::cols8<{k[1]}, {k[2]}, " in line]
            seen.update(k for k in keys if f"id_{k[0]}::cols_range<{k[1]}, {k[2]}>" in line)
        elif fn_keys and "prefetcht1" in line:
            for k in fn_keys:
                per_key[k] += 1
    assert seen == set(keys), sorted(set(keys) - seen)
    assert all(n > 0 for n in per_key.values()), per_key


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("kind,with_mins", CASES)
def test_bfloat16_output_is_the_rounded_float32_output(isa, kind, with_mins):
    """A bfloat16 output (the rows kernel rounds the rows as it writes them, 8 x 8 register
    transposes; the columns kernel rounds a float32 copy) has exactly the bits of the float32
    output's ``.to(torch.bfloat16)``, at decode, verify and prefill sizes, with N = 1030 (not a
    multiple of 8: the transposes' scalar tail) over several column panels; outputs span ~1e-3 to
    ~1e5 so that ties and carries into the exponent occur."""
    _require(isa)
    n, k = 1030, 256
    q, scales, mins = _weight(kind, n, k, with_mins=with_mins, seed=51)
    scales = scales * torch.logspace(-1, 4, n).unsqueeze(1)
    g = torch.Generator().manual_seed(52)
    for m in (1, 5, 8, 9, 33, 70):
        x = torch.randn(m, k, generator=g) * torch.linspace(0.05, 4, k)
        y32 = OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.float32, isa)
        y16 = OPS.intdot_gemm(x, q, scales, mins, None, kind, 32, torch.bfloat16, isa)
        assert y16.dtype == torch.bfloat16
        assert torch.equal(y16.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16)), m
