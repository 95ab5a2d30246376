"""W8A8 (int8 weights, dynamic per-token int8 activations): linear vs float, batch invariance,
C++ vs torch-reference path, whole tiny model, fused Gemma norm, SmolLM2 end to end.

Stated bounds (measured on this machine with the C++ kernels):
* one linear, Gaussian weights (std 0.05) and activations, output relative L2 error vs fp32
  ``F.linear``: < 3% (measured 0.7-1.1%) for M=1, 64, 300, fp32 and bf16, with a bias.
* a row's output is bit-identical alone or inside any batch (per-token scales, exact int32 sums).
* tiny random Llama, logits at all 32 positions: C++ vs torch-reference path cosine >= 0.9999
  fp32 (measured >= 0.9999997) and >= 0.9995 bf16 (measured 0.99995); quantized vs unquantized
  fp32 model cosine >= 0.99 (measured >= 0.99993) and top-1 agreement >= 85% (measured 94-100%).
* SmolLM2-135M bf16, greedy outputs of a batch of 4 prompts equal each prompt's output alone
  (the perplexity bound is in test_weight_only.py: +2.7%).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pagedllm.kernels.cpu_ops as cpu_ops
import pagedllm.quantization.w8a8 as w8a8
from pagedllm.models.layers import RMSNorm
from pagedllm.quantization import quantize_model
from pagedllm.quantization.w8a8 import QuantizedActivation, W8A8Linear, W8A8LinearMethod, quantize_rows, quantize_rows_ref

torch.set_num_threads(1)

HAS_OPS = cpu_ops.get_ops() is not None


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def _no_cpp(monkeypatch) -> None:
    """Run everything on the torch reference paths."""
    monkeypatch.setattr(w8a8, "_ops", lambda: None)
    monkeypatch.setattr(cpu_ops, "get_ops", lambda: None)


# ----------------------------------------------------------------------------- one linear
@pytest.mark.parametrize("shape", [(128, 64), (960, 576), (100, 36)])
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_close_to_float(shape, m, dtype):
    g = torch.Generator().manual_seed(0)
    n, k = shape
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.01
    x = torch.randn(m, k, generator=g)
    lin = W8A8Linear(w, b)
    assert w8a8.int8_weight(lin).dtype == torch.int8 and lin.w_scales.dtype == torch.float32
    assert torch.equal(w8a8.int8_weight(lin), w8a8.quantize_int8(w)[0])  # packed or not, the same weights
    y = lin(x.to(dtype))
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, F.linear(x, w, b)) < 0.03
    no_bias = W8A8Linear(w)
    assert _rel(no_bias(x.to(dtype)), F.linear(x, w)) < 0.03
    # out_dtype forces float32 (the LM head) whatever the activation dtype
    head = W8A8Linear(w, b, out_dtype=torch.float32)
    yh = head(x.to(dtype))
    assert yh.dtype == torch.float32 and _rel(yh, F.linear(x, w, b)) < 0.03
    # leading dims are kept
    assert lin(x.to(dtype).reshape(1, m, k)).shape == (1, m, n)


def test_linear_takes_a_quantized_activation():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g) * 0.05
    lin = W8A8Linear(w, torch.randn(96, generator=g))
    x = torch.randn(5, 64, generator=g).bfloat16()
    qa = quantize_rows(x)
    assert isinstance(qa, QuantizedActivation) and qa.dtype == torch.bfloat16
    assert torch.equal(lin(qa), lin(x))
    with pytest.raises(ValueError, match="bias"):
        lin.quant_method.forward_silu_mul_quant(lin, x)
    assert lin.quant_method.apply_act_and_mul(lin, x, F.silu) is None  # biased: the caller runs apply


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(dtype):
    """A row's output is bit-identical alone or inside a batch of very different rows."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(320, 192, generator=g) * 0.05
    lin = W8A8Linear(w, torch.randn(320, generator=g) * 0.01)
    rows = torch.randn(8, 192, generator=g).to(dtype)
    alone = [lin(rows[i : i + 1]) for i in range(8)]
    for m in (9, 64, 300):
        batch = (torch.randn(m, 192, generator=g) * torch.logspace(-4, 4, m)[:, None]).to(dtype)
        perm = torch.randperm(m, generator=g)
        idx, zero = perm[:8], int(perm[8])
        batch[idx] = rows
        batch[zero] = 0  # a zero row too
        out = lin(batch)
        for i, j in enumerate(idx.tolist()):
            assert torch.equal(out[j : j + 1], alone[i]), (m, i)
        assert torch.equal(out[zero], lin.bias.detach().to(dtype))  # a zero row gives just the bias
    # and the fused gate/up path too
    lin_nb = W8A8Linear(w)
    a = lin_nb.quant_method.forward_silu_mul_quant(lin_nb, rows[:1])
    b = lin_nb.quant_method.forward_silu_mul_quant(lin_nb, torch.cat([rows[:1], rows[1:] * 300]))
    assert torch.equal(a.q, b.q[:1]) and torch.equal(a.scale, b.scale[:1])


def test_silu_mul_quant_matches_float():
    g = torch.Generator().manual_seed(3)
    inter, k = 160, 96
    w = torch.randn(2 * inter, k, generator=g) * 0.05
    lin = W8A8Linear(w)
    x = torch.randn(7, k, generator=g)
    qa = lin.quant_method.forward_silu_mul_quant(lin, x)
    assert qa.q.shape == (7, inter) and qa.dtype == torch.float32
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert _rel(qa.q.float() * qa.scale[:, None], want) < 0.05


# ----------------------------------------------------------------------------- packed VNNI GEMM
HAS_VNNI_GEMM = HAS_OPS and hasattr(cpu_ops.get_ops(), "int8_gemm_supported") and \
    cpu_ops.get_ops().int8_gemm_supported()


def test_pack_int8_weight_layout():
    g = torch.Generator().manual_seed(5)
    n, k = 37, 10  # neither a multiple of 16 columns nor of 4 k: both padded with zeros
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    packed, comp = w8a8.pack_int8_weight(w)
    assert packed.shape == (3, 3, 64) and packed.dtype == torch.int8
    assert comp.shape == (48,) and comp.dtype == torch.int32
    for nb in range(3):
        for kq in range(3):
            for j in range(16):
                for i in range(4):
                    nn_, kk = 16 * nb + j, 4 * kq + i
                    want = int(w[nn_, kk]) if nn_ < n and kk < k else 0
                    assert int(packed[nb, kq, 4 * j + i]) == want
    assert comp[:n].tolist() == [128 * int(r.sum()) for r in w.long()] and not comp[n:].any()
    assert torch.equal(w8a8.unpack_int8_weight(packed, n, k), w)
    with pytest.raises(ValueError, match="int8"):
        w8a8.pack_int8_weight(w.float())


@pytest.mark.skipif(not HAS_VNNI_GEMM, reason="the packed int8 GEMM needs the C++ kernels with AVX512-VNNI")
@pytest.mark.parametrize("shape", [(1, 1), (17, 5), (100, 36), (960, 576), (33, 1539)])
def test_int8_gemm_packed_exact(shape):
    """The kernel's int32 sums equal exact integer matmul for every tile shape (M mod 6, N mod 64)."""
    ops = cpu_ops.get_ops()
    g = torch.Generator().manual_seed(6)
    n, k = shape
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w[0, :] = 127  # extremes: u = 255 against +-127/-128
    packed, comp = w8a8.pack_int8_weight(w)
    for m in (0, 1, 5, 6, 7, 13, 16, 17, 64):  # 7..16: the tall tile
        x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        if m:
            x[0, :] = 127
            x[-1, :] = -128
        got = ops.int8_gemm_packed(x, packed, comp, n)
        assert got.dtype == torch.int32 and got.shape == (m, n)
        assert torch.equal(got, (x.long() @ w.long().t()).int()), (shape, m)
    with pytest.raises(RuntimeError, match="groups of 4 k"):
        ops.int8_gemm_packed(torch.zeros(2, k + 4, dtype=torch.int8), packed, comp, n)


@pytest.mark.skipif(not HAS_VNNI_GEMM, reason="the packed int8 GEMM needs the C++ kernels with AVX512-VNNI")
@pytest.mark.parametrize("shape", [(1, 1), (17, 5), (100, 36), (33, 1539)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_packed_dequant_equals_gemm_then_dequant(shape, dtype, with_bias):
    """The GEMM with the dequantization epilogue is bit-identical to dequant_int32 of its int32 sums."""
    ops = cpu_ops.get_ops()
    g = torch.Generator().manual_seed(9)
    n, k = shape
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    packed, comp = w8a8.pack_int8_weight(w)
    sw = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = (torch.randn(n, generator=g) * 3).to(dtype) if with_bias else None
    for m in (0, 1, 5, 6, 7, 13, 16, 17, 64):  # 7..16: the tall tile
        x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        sx = torch.rand(m, generator=g) * 0.1
        if m:
            sx[0] = 0.0  # an all-zero row has scale 0
        got = ops.int8_gemm_packed_dequant(x, packed, comp, n, sx, sw, bias, dtype)
        ref = ops.dequant_int32(ops.int8_gemm_packed(x, packed, comp, n), sx, sw, bias, dtype)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, ref), (shape, m)
        exact = (x.double() @ w.double().t()) * sx.double()[:, None] * sw.double()[None, :]
        if bias is not None:
            exact = exact + bias.double()
        if m:
            torch.testing.assert_close(got.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    with pytest.raises(RuntimeError, match="sx must be float32"):
        ops.int8_gemm_packed_dequant(torch.zeros(2, k, dtype=torch.int8), packed, comp, n, torch.ones(3), sw, None,
                                     torch.float32)


@pytest.mark.skipif(not HAS_VNNI_GEMM, reason="the packed int8 GEMM needs the C++ kernels with AVX512-VNNI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_onednn_paths_identical(dtype, monkeypatch):
    """W8A8Linear gives bit-identical outputs whether its GEMM runs packed (VNNI) or torch._int_mm."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(200, 96, generator=g) * 0.05
    lin = W8A8Linear(w, torch.randn(200, generator=g) * 0.01)
    gate_up_lin = W8A8Linear(w)  # the fused SiLU path takes no bias
    # one copy of the weights: packed (the [N, K] form is unpacked on demand for large M)
    assert lin.weight_packed is not None and lin.weight_int8 is None
    for m in (1, 16, 70):
        x = torch.randn(m, 96, generator=g).to(dtype)
        monkeypatch.setattr(w8a8, "PACKED_GEMM_MAX_M", 1000)
        packed = lin(x)
        gate_up = gate_up_lin.quant_method.forward_silu_mul_quant(gate_up_lin, x)
        monkeypatch.setattr(w8a8, "PACKED_GEMM_MAX_M", 0)
        onednn = lin(x)
        gate_up_ref = gate_up_lin.quant_method.forward_silu_mul_quant(gate_up_lin, x)
        assert torch.equal(packed, onednn), m
        assert torch.equal(gate_up.q, gate_up_ref.q) and torch.equal(gate_up.scale, gate_up_ref.scale)


HAS_NK_GEMM = HAS_OPS and hasattr(cpu_ops.get_ops(), "int8_gemm_nk_supported") and cpu_ops.get_ops().int8_gemm_nk_supported()


@pytest.mark.skipif(not HAS_NK_GEMM, reason="the [N, K] int8 GEMM needs the C++ kernels with AVX2")
@pytest.mark.parametrize("k", [1, 31, 32, 96, 577])
def test_int8_gemm_nk_exact(k):
    """int8_gemm_nk's int32 sums equal exact integer matmul for every tile shape (M mod 4 / 2, N mod
    2 / 4, the 64-row and 64-column blocks, K tails), activations -127..127, weights -128..127."""
    ops = cpu_ops.get_ops()
    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 3, 5, 64, 67, 130):
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        w[0, :] = -128
        w[-1, ::2] = 127
        for m in (0, 1, 2, 3, 5, 8, 65, 131):
            x = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
            if m:
                x[0, :] = 127
                x[-1, :] = -127
            got = ops.int8_gemm_nk(x, w)
            assert got.dtype == torch.int32 and got.shape == (m, n)
            assert torch.equal(got, (x.long() @ w.long().t()).int()), (n, k, m)
    with pytest.raises(RuntimeError, match="K="):
        ops.int8_gemm_nk(torch.zeros(2, k + 1, dtype=torch.int8), w)


@pytest.mark.skipif(not HAS_NK_GEMM, reason="the [N, K] int8 GEMM needs the C++ kernels with AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nk_and_int_mm_paths_identical(dtype, monkeypatch):
    """W8A8Linear on the plain [N, K] weight (CPUs without VNNI) gives bit-identical outputs with
    int8_gemm_nk and with torch._int_mm."""
    monkeypatch.setattr(w8a8, "PACKED_GEMM_MAX_M", 0)  # the weight stays [N, K], as without VNNI
    g = torch.Generator().manual_seed(9)
    w = torch.randn(200, 96, generator=g) * 0.05
    lin = W8A8Linear(w, torch.randn(200, generator=g) * 0.01)
    gate_up_lin = W8A8Linear(w)
    assert lin.weight_int8 is not None and lin.weight_packed is None
    for m in (1, 3, 70):
        x = torch.randn(m, 96, generator=g).to(dtype)
        monkeypatch.setattr(w8a8, "_NK_GEMM", True)
        nk = lin(x)
        gate_up = gate_up_lin.quant_method.forward_silu_mul_quant(gate_up_lin, x)
        monkeypatch.setattr(w8a8, "_NK_GEMM", False)
        ref = lin(x)
        gate_up_ref = gate_up_lin.quant_method.forward_silu_mul_quant(gate_up_lin, x)
        assert torch.equal(nk, ref), m
        assert torch.equal(gate_up.q, gate_up_ref.q) and torch.equal(gate_up.scale, gate_up_ref.scale)


# ----------------------------------------------------------------------------- tiny model


def _logits(model, ids):
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention
    with torch.inference_mode(), set_forward_context(ForwardContext(None, [], TorchPagedAttention(use_cpu_kernel=False))):
        h = model(ids, torch.arange(len(ids)))
        return model.compute_logits(h)


def _ids():
    return torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_model_logits_close(tie, monkeypatch, tiny_llama):
    model = tiny_llama(tie)
    ids = _ids()
    ref = _logits(model, ids)
    qm = copy.deepcopy(model)
    stats = quantize_model(qm, "w8a8")
    n_layers = len(qm.model.layers)
    assert stats["method"] == "w8a8" and stats["num_linears"] == 4 * n_layers + 1
    assert stats["fused_norms"] == 2 * n_layers
    assert stats["quantized_bytes"] < stats["float_bytes"] / 3
    assert all(isinstance(m.quant_method, W8A8LinearMethod) for m in qm.modules() if isinstance(m, nn.Linear))
    head = qm.logits_processor.tied_head if tie else qm.lm_head
    assert isinstance(head.quant_method, W8A8LinearMethod) and head.quant_method.out_dtype == torch.float32
    for layer in qm.model.layers:
        assert layer.input_layernorm.quantize_output and layer.post_attention_layernorm.quantize_output
        assert type(layer.input_layernorm) is RMSNorm  # same module, a quantizing norm method
        assert isinstance(layer.self_attn.qkv_proj.quant_method, W8A8LinearMethod)
        assert isinstance(layer.mlp.gate_up_proj.quant_method, W8A8LinearMethod)
    assert not getattr(qm.model.norm, "quantize_output", False)  # feeds the head through compute_logits: stays float
    assert qm.model.embed_tokens.weight.dtype == torch.float32

    def check(got):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        cos = F.cosine_similarity(got, ref, dim=-1)
        assert cos.min() >= 0.99, cos
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
        return cos

    got = _logits(qm, ids)
    check(got)
    # the torch reference path (no C++ kernels at all) works and agrees with the fused C++ path
    _no_cpp(monkeypatch)
    got_ref_path = _logits(qm, ids)
    check(got_ref_path)
    if HAS_OPS:
        cos = F.cosine_similarity(got, got_ref_path, dim=-1)
        assert cos.min() >= 0.9999, cos


@pytest.mark.skipif(not HAS_OPS, reason="C++ CPU kernels could not be built here")
def test_cpp_and_reference_paths_agree_bf16(monkeypatch, tiny_llama):
    model = tiny_llama(False).to(torch.bfloat16)
    quantize_model(model, "w8a8")
    ids = _ids()
    a = _logits(model, ids)
    _no_cpp(monkeypatch)
    b = _logits(model, ids)
    assert a.dtype == b.dtype == torch.float32
    assert F.cosine_similarity(a, b, dim=-1).min() >= 0.9995


# ----------------------------------------------------------------------------- fused norms
def _norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * (1.0 + w.float())).to(x.dtype)
    return w.to(x.dtype) * xf.to(x.dtype)


@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpp", [True, False])
def test_quantized_norm_output_matches_quantized_forward(gemma, dtype, cpp, monkeypatch):
    if cpp and not HAS_OPS:
        pytest.skip("C++ CPU kernels could not be built here")
    if not cpp:
        _no_cpp(monkeypatch)
    g = torch.Generator().manual_seed(4)
    dim, eps = 320, 1e-6
    norm = RMSNorm(dim, eps, gemma=gemma)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g) * 0.5 + (0.0 if gemma else 1.0))
    norm = norm.to(dtype) if not gemma else norm  # gemma keeps float32 weights, as loaded by Gemma3
    x = (torch.randn(6, dim, generator=g) * 3).to(dtype)
    plain = norm(x)
    assert isinstance(plain, torch.Tensor) and plain.dtype == dtype
    want = _norm_ref(x, norm.weight.detach(), eps, gemma)
    torch.testing.assert_close(plain, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)

    norm.norm_method = w8a8.QuantizingNormMethod()  # what W8A8Config.process_model does
    qa = norm(x)
    assert isinstance(qa, QuantizedActivation) and qa.dtype == dtype
    assert qa.q.dtype == torch.int8 and qa.q.shape == x.shape
    qr, sr = quantize_rows_ref(want)
    deq, deq_ref = qa.q.float() * qa.scale[:, None], qr.float() * sr[:, None]
    # one quantization step, plus the model-dtype rounding of the plain output
    tol = sr[:, None] * 1.001 + deq_ref.abs() * (2 ** -8 if dtype == torch.bfloat16 else 1e-6)
    assert bool(((deq - deq_ref).abs() <= tol).all()), float(((deq - deq_ref).abs() / sr[:, None]).max())
    torch.testing.assert_close(qa.scale, sr, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)
    # a non-2-D input (per-head q/k norms) is not quantized
    assert isinstance(norm(x.reshape(2, 3, dim)), torch.Tensor)


# ----------------------------------------------------------------------------- SmolLM2 end to end
@pytest.mark.slow
def test_smollm2_w8a8_batch_invariant_greedy(smollm2_path):
    from pagedllm import LLM, SamplingParams

    llm = LLM(smollm2_path, dtype="bfloat16", quantization="w8a8", kv_cache_memory=64 * 1024**2,
              max_num_batched_tokens=512, seed=0)
    prompts = ["The capital of France is",
               "Write a short poem about the sea. The waves",
               "1, 2, 3, 4,",
               "Python is a programming language that is widely used for data science, machine learning and"]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)  # NOTE: 16 tokens compared each
    batch = llm.generate(prompts, sp, use_tqdm=False)
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    for b, a in zip(batch, alone):
        assert len(b.outputs[0].token_ids) == 16
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids), (b.outputs[0].text, a.outputs[0].text)
        assert b.outputs[0].text == a.outputs[0].text
    assert "Paris" in batch[0].outputs[0].text, batch[0].outputs[0].text
    assert len({b.outputs[0].text for b in batch}) == 4
