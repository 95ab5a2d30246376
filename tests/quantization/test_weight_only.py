"""Weight-only int8 / int4 quantization: kernels vs float reference, whole-model logits, perplexity.

Stated bounds (measured values in docs/performance.md "Low-bit weights"):
* one linear, Gaussian weights, output relative L2 error vs the fp32 reference:
  int8 < 2% (measured 0.7-0.9%), int4 gs32 < 10% (measured 7-8%), for M=1, 64, 300, fp32 and bf16.
* tiny random Llama, last-position logits vs the unquantized fp32 model: cosine >= 0.99 (int8) /
  0.95 (int4) (measured >= 0.9999 / 0.996); top-1 agreement over 32 positions >= 85% (int8) /
  75% (int4) (measured 94-100% / 91-100%).
* SmolLM2-135M, perplexity of a fixed 400-token English text (bench._SENTENCES), bf16 engine:
  int8 within 2% of bf16 (measured -0.4%), int4 within 15% (measured +6.4%), W8A8 (int8
  weights and per-token int8 activations, pagedllm.quantization.w8a8) within 6% (measured
  32.15 vs 31.31, +2.7%).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pagedllm.quantization import WeightOnlyInt4Linear, WeightOnlyInt8Linear, quantize_model
from pagedllm.quantization.weight_only import quantize_int4

torch.set_num_threads(1)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("cls,bound", [(WeightOnlyInt8Linear, 0.02), (WeightOnlyInt4Linear, 0.10)])
@pytest.mark.parametrize("shape", [(128, 64), (960, 576), (96, 64)])  # 96: int4 kernel-only path
@pytest.mark.parametrize("m", [1, 64, 300])  # > large_m (int8 32, int4 256): dequantize + bf16 matmul
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_close_to_float(cls, bound, shape, m, dtype):
    g = torch.Generator().manual_seed(0)
    n, k = shape
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) * 0.01
    x = torch.randn(m, k, generator=g)
    q = cls(w, b)
    y = q(x.to(dtype))
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, x @ w.t() + b) < bound
    # 3-D input keeps its leading dims
    assert q(x.to(dtype).reshape(1, m, k)).shape == (1, m, n)


@pytest.mark.parametrize("cls", [WeightOnlyInt8Linear, WeightOnlyInt4Linear])
def test_kernel_and_dequantized_paths_agree(cls):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(192, 128, generator=g) * 0.05
    q = cls(w)
    x = torch.randn(8, 128, generator=g).bfloat16()
    wd = q.quant_method.dequantize_bf16(q)
    if wd is None and cls is WeightOnlyInt4Linear:
        assert not q._int4_can_dequantize
        pytest.skip("torch packs int4 in a layout this CPU's dequantizer does not read (kernel only)")
    assert wd is not None and wd.dtype == torch.bfloat16
    ref = x.float() @ wd.float().t()
    assert _rel(q.quant_method._kernel(q, x), ref) < 1e-2


def test_int4_convention_dequantizes_to_the_weight():
    """The op computes ``x @ ((q - 8) * scale + zero).T``: identity input recovers that matrix."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g)
    q, s, z = quantize_int4(w, 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack((s.t(), z.t()), dim=-1).contiguous()
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(64), packed, 32, sz).t()
    want = (q - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - w).abs().max() <= (s.max() / 2) * 1.01  # rounding error at most half a step


def test_int4_rejects_bad_group():
    with pytest.raises(ValueError, match="group_size"):
        WeightOnlyInt4Linear(torch.randn(64, 576), group_size=128)




def _logits(model, ids):
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention
    with torch.inference_mode(), set_forward_context(ForwardContext(None, [], TorchPagedAttention(use_cpu_kernel=False))):
        h = model(ids, torch.arange(len(ids)))
        return model.compute_logits(h)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("method,cos_min,top1_min", [("int8", 0.99, 0.85), ("int4", 0.95, 0.75)])
def test_tiny_model_logits_close(tie, method, cos_min, top1_min, tiny_llama):
    import copy
    model = tiny_llama(tie)
    ids = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(3))
    ref = _logits(model, ids)
    qm = copy.deepcopy(model)
    stats = quantize_model(qm, method)
    assert stats["num_linears"] == 2 * 4 + 1  # qkv, o, gate_up, down per layer + head
    assert stats["quantized_bytes"] < stats["float_bytes"] / (3 if method == "int8" else 6)
    # every linear (and the tied head) runs its method; no float weight is left behind
    linears = [m for m in qm.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == stats["num_linears"] and all(m.quant_method is not None for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)
    assert qm.model.embed_tokens.weight.dtype == torch.float32  # lookups stay float
    got = _logits(qm, ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() >= cos_min, cos
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= top1_min


def test_quantize_model_rejects_unknown_method(tiny_llama):
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(tiny_llama(True), "int3")


@pytest.mark.slow
def test_smollm2_perplexity_and_greedy(smollm2_path):
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import _SENTENCES

    text = " ".join(_SENTENCES)
    ppl, weight_bytes, gen = {}, {}, {}
    for q in ("none", "int8", "int4", "w8a8"):  # "none": the Q4_1 file dequantized (the baseline), in the dtype "auto" picks: bf16 where the CPU has it natively, else float32 (emulated bf16 made this test take 2 min on AVX2-only CPUs)
        llm = LLM(smollm2_path, dtype="auto", quantization=q, kv_cache_memory=64 * 1024**2,
                  max_num_batched_tokens=512, seed=0)
        core = llm.llm_engine.core
        ids = core.tokenizer.encode(text, add_special_tokens=False)[:400]
        assert len(ids) == 400
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
        lps = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], ids[1:])]
        ppl[q] = math.exp(-sum(lps) / len(lps))
        weight_bytes[q] = core.weight_bytes
        gen[q] = llm.generate(["The capital of France is"],
                              SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
        del llm
    assert ppl["int8"] <= ppl["none"] * 1.02, ppl
    assert ppl["int4"] <= ppl["none"] * 1.15, ppl
    assert ppl["w8a8"] <= ppl["none"] * 1.06, ppl
    assert weight_bytes["int8"] < 0.75 * weight_bytes["none"] and weight_bytes["int4"] < 0.55 * weight_bytes["none"]
    assert weight_bytes["w8a8"] < 0.75 * weight_bytes["none"]
    assert all("Paris" in g for g in gen.values()), gen
