"""8-bit floating-point KV cache (``kv_cache_dtype="fp8"`` / ``"fp8_e5m2"``).

* the C++ cache store encodes exactly as torch's ``.to(float8)`` (round to nearest even), and
  saturates where torch gives NaN / inf, as ``to_cache_dtype`` does;
* the C++ decode and prefill kernels reading an fp8 cache equal the pure-torch path reading the
  same cache (bf16 tolerance);
* SmolLM2 bf16 end to end (the default GGUF path: integer-dot kernel, int8 activations): the same
  byte budget holds twice the tokens; perplexity of a fixed 400-token text within 2% (E4M3,
  measured +0.7%) / 8% (E5M2, measured +6.6%) of the bf16 cache (with float activations,
  ``PAGEDLLM_GGUF_INTDOT=0``: -0.4% / +3.8%: E5M2's 2-bit mantissa and the int8 activation
  codes add up); the same greedy first token for at least 6 of 8 prompts (E4M3, measured 8/8);
* settings: vLLM's names, a ValueError naming the field otherwise, CPU only.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata, to_cache_dtype, write_kv
from pagedllm.kernels.cpu_ops import get_ops
from pagedllm.platforms import resolve_kv_cache_dtype

ops = get_ops()
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KERNEL = ops is not None and hasattr(ops, "kv_fp8_supported") and \
    ops.kv_fp8_supported(torch.empty(1, 1, 64, dtype=torch.bfloat16))


def _all_codes_and_midpoints(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties), and values just
    off them, in float32, both signs, plus out-of-range values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    vals = codes[torch.isfinite(codes)].unique().sort().values
    pos = vals[vals >= 0]
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([pos, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), pos * 0.3, torch.rand(4000) * pos.max()])
    return torch.cat([x, -x])


@pytest.mark.skipif(ops is None, reason="C++ CPU kernels could not be built here")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_cache_store_encodes_like_torch(dtype, src):
    x = _all_codes_and_midpoints(dtype).to(src)
    d = 64
    n = x.numel() // d * d
    k = x[:n].view(-1, 1, d)
    v = -k.flip(0)
    t = k.shape[0]
    bs = 4
    nb = t // bs + 2
    slots = torch.arange(t, dtype=torch.int64) + bs  # skip block 0
    a = torch.zeros(nb, 2, bs, 1, d, dtype=dtype)
    b = torch.zeros_like(a)
    write_kv(a, k, v, slots, ops)  # C++
    write_kv(b, k, v, slots, None)  # torch
    want = k.float().to(dtype)  # torch's own conversion (all values here are in range)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    got = a[slots // bs, 0, slots % bs]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_out_of_range_values_saturate(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([1e9, -1e9, big * 1.5, big, -big * 1.01])
    got = to_cache_dtype(x, dtype).float()
    assert got.tolist() == [big, -big, big, big, -big]
    if ops is not None:
        cache = torch.zeros(2, 2, 8, 1, 5, dtype=dtype)
        write_kv(cache, x.view(1, 1, 5), x.view(1, 1, 5), torch.tensor([8]), ops)
        assert cache[1, 0, 0, 0].float().tolist() == [big, -big, big, big, -big]


def _fp8_cache(nb, bs, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return to_cache_dtype(torch.randn(nb, 2, bs, hkv, d, generator=g) * 2, dtype)


@pytest.mark.skipif(not KERNEL, reason="the fp8 cache kernels need AVX512-BF16")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 256, 16), (16, 2, 128, 4), (12, 1, 64, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (7, None), (33, 5.0)])
def test_decode_kernel_reads_fp8_cache(dtype, hq, hkv, d, bs, window, cap):
    rng = random.Random(hq * 100 + d + bs)
    nb = 300
    kv = _fp8_cache(nb, bs, hkv, d, dtype, hq + d)
    free = list(range(1, nb))
    rng.shuffle(free)
    reqs = []
    for L in [1, 2, bs, bs + 1, 3 * bs + 5, 77, 200]:
        n = math.ceil(L / bs)
        reqs.append((L - 1, 1, free[:n]))
        free = free[n:]
    meta = build_metadata(reqs, bs)
    q = torch.randn(len(reqs), hq, d, generator=torch.Generator().manual_seed(d)).to(torch.bfloat16)
    out = ops.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, d ** -0.5, window or 0, cap or 0.0)
    # reference: the torch path on the same cache widened to float32
    ref = TorchPagedAttention._decode(q.float(), kv, meta, d ** -0.5, window, cap)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not KERNEL, reason="the fp8 cache kernels need AVX512-BF16")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 256, 16)])
@pytest.mark.parametrize("window,cap", [(None, None), (40, 5.0)])
@pytest.mark.parametrize("ctx,lq", [(0, 37), (0, 200), (50, 45)])
def test_prefill_kernel_reads_fp8_cache(dtype, hq, hkv, d, bs, window, cap, ctx, lq):
    rng = random.Random(hq + d + ctx + lq)
    L = ctx + lq
    n = math.ceil(L / bs)
    nb = n + 10
    blocks = rng.sample(range(1, nb), n)
    kv = _fp8_cache(nb, bs, hkv, d, dtype, lq)
    meta = build_metadata([(ctx, lq, blocks)], bs)
    q = torch.randn(lq, hq, d, generator=torch.Generator().manual_seed(ctx)).to(torch.bfloat16)
    out = ops.paged_prefill_attention(q, kv, meta.block_tables[0], ctx, d ** -0.5, window or 0, cap or 0.0)
    pos = torch.arange(L)
    bt = meta.block_tables[0]
    kc = kv[bt[pos // bs], 0, pos % bs].transpose(0, 1).float()
    vc = kv[bt[pos // bs], 1, pos % bs].transpose(0, 1).float()
    ref = TorchPagedAttention._prefill(q.float(), kc, vc, ctx, d ** -0.5, window, cap)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", FP8)
def test_backend_mixed_batch_fp8(dtype):
    """Decodes + prefill chunks in one step over an fp8 cache: kernels vs pure torch, and both
    write the same bytes."""
    torch.manual_seed(2)
    bs, hq, hkv, d = 16, 9, 3, 64
    reqs = [(5, 1, [1]), (40, 1, [2, 3, 4]), (0, 70, [5, 6, 7, 8, 9]), (20, 30, [10, 11, 12, 13])]
    meta = build_metadata(reqs, bs)
    t = sum(n for _, n, _ in reqs)
    ctx = _fp8_cache(20, bs, hkv, d, dtype, 3)
    kv_a, kv_b = ctx.clone(), ctx.clone()
    q, k, v = (torch.randn(t, h, d).to(torch.bfloat16) for h in (hq, hkv, hkv))
    a = TorchPagedAttention(use_cpu_kernel=True).forward(q, k, v, kv_a, meta, d ** -0.5, None, None)
    b = TorchPagedAttention(use_cpu_kernel=False).forward(q, k, v, kv_b, meta, d ** -0.5, None, None)
    assert torch.equal(kv_a.view(torch.uint8), kv_b.view(torch.uint8))
    torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def test_kv_cache_dtype_setting():
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cpu) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32, cpu) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, cpu) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="kv_cache_dtype.*CPU"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"))


@pytest.mark.slow
def test_smollm2_with_fp8_cache(smollm2_path):
    """SmolLM2 bf16 with an fp8 KV cache: twice the tokens per byte budget, perplexity of a fixed
    400-token text close to the bf16 cache's, the same greedy first tokens."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import _SENTENCES, builtin_workload

    text = " ".join(_SENTENCES)
    ppl, blocks, first, paris = {}, {}, {}, {}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        # (a size string is accepted too, as on the command line)
        llm = LLM(smollm2_path, dtype="bfloat16", kv_cache_dtype=kv,
                  kv_cache_memory="64MiB" if kv == "fp8" else 64 * 1024**2, max_num_batched_tokens=512, seed=0)
        core = llm.llm_engine.core
        blocks[kv] = core.num_blocks
        ids = core.tokenizer.encode(text, add_special_tokens=False)[:400]
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)[0]
        lps = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], ids[1:])]
        ppl[kv] = math.exp(-sum(lps) / len(lps))
        prompts = builtin_workload(core.tokenizer, 8, 50, 200, seed=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        first[kv] = [o.outputs[0].token_ids[0] for o in outs]
        paris[kv] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0),
                                 use_tqdm=False)[0].outputs[0].text
        del llm
    assert blocks["fp8"] == blocks["fp8_e5m2"] == 2 * blocks["auto"], blocks
    # measured 2026-12-02, default (integer-dot) path: auto 31.31, fp8 (E4M3) 31.53 (+0.7%),
    # fp8_e5m2 33.39 (+6.6%); float activations (PAGEDLLM_GGUF_INTDOT=0): 31.42, 31.29 (-0.4%), 32.62 (+3.8%)
    assert ppl["fp8"] <= ppl["auto"] * 1.02 and ppl["fp8_e5m2"] <= ppl["auto"] * 1.08, ppl
    # NOTE: later greedy tokens are not compared: this small model's bf16 logits often tie or
    # differ by one bf16 step, and the bf16-cache run itself changes them between code paths.
    assert sum(a == b for a, b in zip(first["auto"], first["fp8"])) >= 6, first  # measured 8/8
    assert all("Paris" in t for t in paris.values()), paris
