"""The fused decode paths (``llama_decode_w8a8``, ``llama_decode_dense``, ``llama_decode_group``)
against the module path they replace.

They call the same kernels in the same order, so hidden states and the KV cache they write must be
bit-identical to the module path's: W8A8 and float weights (float32, bfloat16, bfloat16 packed for
oneDNN), group-quantized weights (GGUF blocks: Q4_1 through ``group_gemm`` and the integer-dot
kernel, K-quants / Q8_0 / merged shards of mixed types), a bf16 or fp8 cache, biases and sliding windows; steps they do not run (prefill, mixed,
too many rows, an unreadable cache) must fall back.
"""
from __future__ import annotations

import pytest
import torch

import pagedllm.kernels.cpu_ops as cpu_ops
import pagedllm.quantization.w8a8 as w8a8
from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata
from pagedllm.worker.fused_decode import FusedDecode, decode_step
from pagedllm.quantization import quantize_model

torch.set_num_threads(1)

OPS = cpu_ops.get_ops()
pytestmark = pytest.mark.skipif(OPS is None or not hasattr(OPS, "llama_decode_group"),
                                reason="needs the C++ kernels (a C++ compiler at first use)")
# W8A8's fused step runs the packed int8 GEMM (AVX512-VNNI); "prepack" needs oneDNN's bf16 packing.
# The group (GGUF) and dense paths run on any CPU the kernels build for (AVX2 included).
VNNI = OPS is not None and OPS.int8_gemm_supported()
needs_vnni = pytest.mark.skipif(not VNNI, reason="needs avx512_vnni, avx512bw (the W8A8 packed int8 GEMM)")


def _prepack_ok() -> bool:
    from pagedllm.kernels.onednn import pack_bf16_weight

    return pack_bf16_weight(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None


needs_prepack = pytest.mark.skipif(not _prepack_ok(), reason="onednn cannot pack bf16 weights on this CPU "
                                                             "(needs avx512bw/vl/dq or avx_ne_convert)")


def _mode(mode: str, *rest):
    """A parametrize case for ``mode``, skipped where its kernels cannot run."""
    marks = {"w8a8": [needs_vnni], "prepack": [needs_prepack]}.get(mode, [])
    return pytest.param(mode, *rest, marks=marks)

BLOCK = 4


def _model(dtype, bias=False, window=None, hidden=128, mode="w8a8"):
    """A random 3-layer Llama: ``mode`` "w8a8" (quantized), "dense" (float weights) or "prepack"
    (bf16 weights packed for oneDNN, as the engine leaves an unquantized bf16 model)."""
    from transformers import LlamaConfig

    from pagedllm.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, attention_bias=bias, architectures=["LlamaForCausalLM"])
    if window:
        cfg.sliding_window = window
        cfg.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 1.0 if "embed" in name else (0.05 if p.dim() > 1 else 0.1))
    if mode == "w8a8":
        quantize_model(model, "w8a8")
    elif mode == "prepack":
        from pagedllm.kernels.onednn import prepack_cpu_linears

        assert prepack_cpu_linears(model) > 0
    return model.eval()


def _plan(model):
    """The model's decode plan, as the engine builds it once the model is finished."""
    return FusedDecode.build(model.model)


def _forward(model, ids, positions, caches, meta, fused: bool):
    """One forward as the runner does it (``decode_step``); ``fused`` gives it the model's plan.
    Returns (hidden, whether the fused kernel ran)."""
    plan = _plan(model) if fused else None
    ran = []
    if plan is not None:
        real = plan.ops

        class Spy:  # counts calls of the fused kernel, forwards everything else
            def __getattr__(self, name):
                return getattr(real, name)

            def llama_decode_w8a8(self, *a, **k):
                ran.append(1)
                return real.llama_decode_w8a8(*a, **k)

            def llama_decode_dense(self, *a, **k):
                ran.append(1)
                return real.llama_decode_dense(*a, **k)

            def llama_decode_group(self, *a, **k):
                ran.append(1)
                return real.llama_decode_group(*a, **k)

        plan.ops = Spy()
    ctx = ForwardContext(attn_metadata=meta, kv_caches=caches, impl=TorchPagedAttention())
    with torch.inference_mode(), set_forward_context(ctx):
        h = decode_step(plan, model, ids, positions)
    return h, bool(ran)


def _prefill(model, lens, cache_dtype, dtype):
    """Prefill requests of ``lens`` tokens into fresh caches; returns (caches, block lists)."""
    n_layers = len(model.model.layers)
    nb = sum(-(-(n + 8) // BLOCK) for n in lens) + 1
    _, hkv, d = model.get_kv_cache_spec()
    caches = [torch.zeros(nb, 2, BLOCK, hkv, d, dtype=cache_dtype or dtype) for _ in range(n_layers)]
    blocks, nxt = [], 1
    for n in lens:
        k = -(-(n + 8) // BLOCK)
        blocks.append(list(range(nxt, nxt + k)))
        nxt += k
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (sum(lens),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = build_metadata([(0, n, b) for n, b in zip(lens, blocks)], BLOCK)
    _, ran = _forward(model, ids, positions, caches, meta, fused=True)
    assert not ran  # prefill steps take the module path
    return caches, blocks


def _decode_both(model, lens, caches, blocks, steps=3):
    """``steps`` decode steps on copies of ``caches`` by each path; asserts bit-identity."""
    a = [c.clone() for c in caches]
    b = [c.clone() for c in caches]
    g = torch.Generator().manual_seed(2)
    lens = list(lens)
    for _ in range(steps):
        ids = torch.randint(0, 512, (len(lens),), generator=g)
        positions = torch.tensor(lens, dtype=torch.int64)
        meta = build_metadata([(n, 1, bl) for n, bl in zip(lens, blocks)], BLOCK)
        h_mod, ran_mod = _forward(model, ids, positions, a, meta, fused=False)
        h_fused, ran_fused = _forward(model, ids, positions, b, meta, fused=True)
        assert ran_fused and not ran_mod
        assert h_fused.dtype == h_mod.dtype and h_fused.shape == h_mod.shape
        assert torch.equal(h_fused, h_mod)
        for ca, cb in zip(a, b):
            assert torch.equal(ca.view(torch.uint8), cb.view(torch.uint8))
        lens = [n + 1 for n in lens]
    return h_fused


@pytest.mark.parametrize("mode,dtype", [_mode("w8a8", torch.float32), _mode("w8a8", torch.bfloat16),
                                        _mode("dense", torch.float32), _mode("dense", torch.bfloat16),
                                        _mode("prepack", torch.bfloat16)])
def test_fused_decode_bit_identical(mode, dtype):
    model = _model(dtype, mode=mode)
    plan = _plan(model)
    assert plan.kind == ("w8a8" if mode == "w8a8" else "dense") and plan.packed == (mode == "prepack")
    lens = [5, 13, 2, 9]
    caches, blocks = _prefill(model, lens, None, dtype)
    h = _decode_both(model, lens, caches, blocks)
    assert torch.isfinite(h.float()).all() and h.float().abs().sum() > 0


@pytest.mark.parametrize("mode", [_mode("w8a8"), _mode("prepack")])
@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_decode_fp8_cache(kv, mode):
    if not OPS.kv_fp8_supported(torch.empty(1, 4, 64, dtype=torch.bfloat16)):
        pytest.skip("no AVX512-BF16 fp8 cache reads here")
    model = _model(torch.bfloat16, hidden=256, mode=mode)  # head size 64: the fp8 reads need 64/128/256
    lens = [7, 3]
    caches, blocks = _prefill(model, lens, kv, torch.bfloat16)
    _decode_both(model, lens, caches, blocks)


@pytest.mark.parametrize("mode", [_mode("w8a8"), _mode("prepack"), _mode("dense")])
def test_fused_decode_bias_and_sliding_window(mode):
    model = _model(torch.bfloat16, bias=True, window=6, mode=mode)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    plan = _plan(model)
    assert plan is not None and plan.windows == [6, 0, 6]
    lens = [11, 4, 17]
    caches, blocks = _prefill(model, lens, None, torch.bfloat16)
    _decode_both(model, lens, caches, blocks, steps=4)


# byte offsets of the f16 fields (d, dmin) inside each GGUF block type (ggml-common.h)
_GGUF_F16_FIELDS = {"Q8_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208], "Q5_0": [0]}


def _gguf_quantize(model, types: dict) -> None:
    """Give each projection GGUF blocks of ``types[name]`` ("qkv", "o", "gate_up", "down"; a list
    for one type per shard, merged as a GGUF file's q/k/v are), random with small f16 scales,
    loaded as ``GGUFLinearMethod`` leaves a GGUF file's linears (``group_quant.install``)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from pagedllm.quantization import group_quant as gq
    from pagedllm.quantization.gguf import GGUFLinearMethod, GGUFRawTensor, gguf_to_group

    rng = np.random.default_rng(3)

    def blocks(name, rows, k):
        qt = GGMLQuantizationType[name]
        block, size = GGML_QUANT_SIZES[qt]
        b = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
        for off in _GGUF_F16_FIELDS[name]:
            b[:, off:off + 2] = (rng.standard_normal(b.shape[0]) * 0.004).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return gguf_to_group(GGUFRawTensor(b.reshape(rows, -1), qt, (rows, k), name))

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for key, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                         ("down", mlp.down_proj)):
            names = types[key] if isinstance(types[key], list) else [types[key]]
            rows = [lin.out_features // len(names)] * len(names)
            if len(names) == 3:  # q, k, v
                kv = attn.num_kv_heads * attn.head_dim
                rows = [lin.out_features - 2 * kv, kv, kv]
            gq.install(lin, gq.merge([blocks(n, r, lin.in_features) for n, r in zip(names, rows)]))
            lin.quant_method = GGUFLinearMethod()


@pytest.mark.parametrize("intdot", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_gguf_q4_1_bit_identical(dtype, intdot, monkeypatch):
    """SmolLM2's file type: every projection Q4_1 (group_gemm; with PAGEDLLM_GGUF_INTDOT=1 the
    integer-dot kernel), biases on q/k/v and o, a sliding window: hidden states and KV cache
    bit-identical to the module path, also past group_gemm's register-path row limit."""
    from pagedllm.quantization import group_quant as gq

    if intdot and cpu_ops.get_intdot_ops() is None:
        pytest.skip("integer-dot kernel not built here")
    monkeypatch.setattr(gq, "INTDOT", intdot)
    model = _model(dtype, bias=True, window=6, mode="dense")
    _gguf_quantize(model, {"qkv": "Q4_1", "o": "Q4_1", "gate_up": "Q4_1", "down": "Q4_1"})
    plan = _plan(model)
    assert plan is not None and plan.kind == "group" and plan.modes[:3] == [gq.KIND_INT4, 32, int(intdot)]
    lens = [5, 13, 2, 9]
    caches, blocks = _prefill(model, lens, None, dtype)
    h = _decode_both(model, lens, caches, blocks)
    assert torch.isfinite(h.float()).all() and h.float().abs().sum() > 0
    monkeypatch.setattr(gq, "LARGE_M", 2)  # 4 rows: group_gemm's dequantized-tile path
    _decode_both(model, lens, caches, blocks, steps=1)


def test_fused_decode_gguf_k_quants_and_mixed_shards():
    """Gemma-style K-quant files: q/k Q5_0 beside v Q8_0 merged into one int8 layout, Q4_K
    (group 32 of 256-blocks), Q6_K (group 16), Q8_0; bf16 activations."""
    model = _model(torch.bfloat16, hidden=256, mode="dense")
    _gguf_quantize(model, {"qkv": ["Q5_0", "Q5_0", "Q8_0"], "o": "Q4_K", "gate_up": "Q6_K", "down": "Q8_0"})
    plan = _plan(model)
    assert plan is not None and plan.kind == "group"
    assert [plan.modes[i] for i in (1, 4, 7, 10)] == [32, 32, 16, 32]
    lens = [7, 3]
    caches, blocks = _prefill(model, lens, None, torch.bfloat16)
    _decode_both(model, lens, caches, blocks)


@needs_vnni  # NOTE: its model is W8A8, which has no plan (so nothing to fall back from) without VNNI
def test_fused_decode_falls_back():
    model = _model(torch.bfloat16)
    lens = [6, 10]
    caches, blocks = _prefill(model, lens, None, torch.bfloat16)
    # a mixed step (one decode, one prefill chunk) runs the module path
    meta = build_metadata([(6, 1, blocks[0]), (10, 3, blocks[1])], BLOCK)
    ids, positions = torch.tensor([1, 2, 3, 4]), torch.tensor([6, 10, 11, 12])
    h, ran = _forward(model, ids, positions, caches, meta, fused=True)
    assert not ran and h.shape == (4, 128)
    # more decode rows than the packed GEMM takes: module path
    old = w8a8.PACKED_GEMM_MAX_M
    try:
        w8a8.PACKED_GEMM_MAX_M = 1
        meta = build_metadata([(7, 1, blocks[0]), (13, 1, blocks[1])], BLOCK)
        _, ran = _forward(model, torch.tensor([5, 6]), torch.tensor([7, 13]), caches, meta, fused=True)
        assert not ran
    finally:
        w8a8.PACKED_GEMM_MAX_M = old
    # an fp32 cache under bf16 activations (not readable by the kernels) also falls back
    f32 = [c.float() for c in caches]
    meta = build_metadata([(7, 1, blocks[0])], BLOCK)
    _, ran = _forward(model, torch.tensor([5]), torch.tensor([7]), f32, meta, fused=True)
    assert not ran
    # a float model whose activations have another dtype than its weights: module path
    dense = _model(torch.float32, mode="dense")
    caches, blocks = _prefill(dense, lens, None, torch.float32)
    meta = build_metadata([(6, 1, blocks[0])], BLOCK)
    ctx = ForwardContext(attn_metadata=meta, kv_caches=caches, impl=TorchPagedAttention())
    with torch.inference_mode(), set_forward_context(ctx):
        assert _plan(dense).run(torch.zeros(1, 128, dtype=torch.bfloat16), torch.tensor([6])) is None


@needs_vnni
@needs_prepack
def test_fused_decode_not_built(monkeypatch, tiny_llama):
    # weight-only quantized models get no plan, and deciding that does not load the C++ kernels
    # (nor may a CUDA model trigger their build)
    def no_build():
        raise AssertionError("get_ops called")

    wo = tiny_llama(True)
    quantize_model(wo, "int8")
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "get_ops", no_build)
        assert _plan(wo) is None
    model = _model(torch.bfloat16)
    assert isinstance(_plan(model), FusedDecode)
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "0")
    assert FusedDecode.build(model.model) is None
    assert FusedDecode.build(_model(torch.bfloat16, mode="prepack").model) is None
    monkeypatch.delenv("PAGEDLLM_FUSED_DECODE")
    # a plan gathered after quantizing or prepacking sees the layers' new methods
    m2 = tiny_llama(True, torch.bfloat16)
    p0 = _plan(m2)
    assert p0.kind == "dense" and not p0.packed
    from pagedllm.kernels.onednn import prepack_cpu_linears

    prepack_cpu_linears(m2)
    p1 = _plan(m2)
    assert p1 is not p0 and p1.kind == "dense" and p1.packed
    m3 = tiny_llama(True, torch.bfloat16)
    assert _plan(m3).kind == "dense"
    quantize_model(m3, "w8a8")
    assert _plan(m3).kind == "w8a8"


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [_mode("w8a8"), pytest.param("none", marks=[needs_prepack]), "gguf"])
def test_smollm2_fused_decode_same_tokens_and_logprobs(smollm2_path, monkeypatch, quantization):
    """End to end through ``LLM`` (W8A8, the file dequantized to bf16 with oneDNN-packed weights,
    and the default: its Q4_1 blocks kept): greedy tokens and logprobs are equal with the fused
    path on and off."""
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about autumn leaves.", "1, 2, 3, 4,"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    got, texts = [], []
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", flag)
        llm = LLM(smollm2_path, dtype="bfloat16", quantization=quantization, kv_cache_memory=32 * 1024**2, seed=0)
        plan = llm.llm_engine.core.runner.decode_accelerator
        assert (plan is not None) == (flag == "1")
        if plan is not None:
            kind = {"w8a8": "w8a8", "none": "dense", "gguf": "group"}[quantization]
            assert plan.kind == kind and plan.packed == (quantization == "none")
        outs = llm.generate(prompts, sp, use_tqdm=False)
        got.append([(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs])
                    for o in outs])
        texts.append(outs[0].outputs[0].text)
        del llm
    assert got[0] == got[1]
    assert "Paris" in texts[0], texts[0]


def test_fused_decode_survives_deepcopy():
    # a model that has run a step can be deep-copied; the copy's plan uses the copy's weights
    import copy

    model = _model(torch.bfloat16, mode="dense")  # NOTE: oneDNN-packed weights cannot be deep-copied at all
    lens = [5, 8]
    caches, blocks = _prefill(model, lens, None, torch.bfloat16)
    twin = copy.deepcopy(model)
    plan = _plan(twin)
    assert plan is not _plan(model) and plan.ops is OPS
    assert plan.layer_tensors[1] is twin.model.layers[0].self_attn.qkv_proj.weight
    h = _decode_both(twin, lens, caches, blocks, steps=1)
    ids, positions = torch.randint(0, 512, (2,), generator=torch.Generator().manual_seed(2)), torch.tensor(lens)
    meta = build_metadata([(n, 1, bl) for n, bl in zip(lens, blocks)], BLOCK)
    h0, ran = _forward(model, ids, positions, [c.clone() for c in caches], meta, fused=True)
    assert ran and torch.equal(h0, h)
