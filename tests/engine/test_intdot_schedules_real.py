"""The default GGUF path (integer-dot GEMM, int8 activations) on the real SmolLM2 Q4_1 across
schedules (slow).

Stated bounds:
* batch-invariant mode keeps the GGUF blocks on the integer-dot GEMM (invariant by construction)
  instead of dequantizing them, and then the 400-token text's prompt logprobs are identical
  (``==``) whether prefilled in one step or in 16-token chunks, and greedy outputs with n-gram
  speculation (k = 4) equal those without, token for token.
* default mode (no invariant attention): the chunked prefill's prompt logprobs stay within the
  int8-activation noise of the one-step run: perplexity within 1% (measured +0.07%), mean
  |logprob difference| < 0.1 nats (measured 0.028); float activations (PAGEDLLM_GGUF_INTDOT=0)
  differ by < 1e-4 there (measured 1.8e-5 max).
"""
from __future__ import annotations

import math

import pytest

import pagedllm.kernels.cpu_ops as cpu_ops
from pagedllm import LLM, SamplingParams
from pagedllm.quantization import group_quant as gq

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpu_ops.get_intdot_ops() is None, reason="integer-dot C++ kernel not built here")]

KW = dict(dtype="float32", kv_cache_memory=64 * 1024**2, seed=0, max_model_len=1024, enable_prefix_caching=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "disable_by_batch_size": 0}
CHATS = [[{"role": "user", "content": "Repeat this text exactly: the quick brown fox jumps over the lazy dog, "
                                      "the quick brown fox jumps over the lazy dog."}],
         [{"role": "user", "content": "List the days of the week."}]]
SP = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _text_ids(llm):
    from pagedllm.entrypoints.bench import _SENTENCES

    return llm.get_tokenizer().encode(" ".join(_SENTENCES), add_special_tokens=False)[:400]


def _prompt_logprobs(llm, ids):
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    return [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], ids[1:])]


def _count_intdot(monkeypatch) -> list:
    calls = []
    real = gq._intdot_ops_for

    def counted(*a):
        ops = real(*a)
        if ops is not None:
            calls.append(1)
        return ops

    monkeypatch.setattr(gq, "_intdot_ops_for", counted)
    return calls


def test_batch_invariant_mode_keeps_blocks_and_is_exact(monkeypatch):
    monkeypatch.setattr(gq, "INTDOT", True)
    calls = _count_intdot(monkeypatch)
    whole = LLM("SmolLM2-135M-Instruct", batch_invariant=True, max_num_batched_tokens=512, **KW)
    ids = _text_ids(whole)
    want = _prompt_logprobs(whole, ids)
    assert calls, "the integer-dot kernel did not run: the blocks were dequantized"
    chats = [whole.llm_engine_apply_chat_template(c) for c in CHATS]
    base = [o.outputs[0].token_ids for o in whole.generate(chats, SP, use_tqdm=False)]
    del whole
    chunked = LLM("SmolLM2-135M-Instruct", batch_invariant=True, max_num_batched_tokens=16,
                  speculative_config=NGRAM, **KW)
    assert _prompt_logprobs(chunked, ids) == want
    spec = [chunked.generate(c, SP, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    assert spec == base
    assert chunked.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_default_mode_chunking_stays_within_int8_noise(monkeypatch):
    monkeypatch.setattr(gq, "INTDOT", True)
    whole = LLM("SmolLM2-135M-Instruct", max_num_batched_tokens=512, **KW)
    ids = _text_ids(whole)
    a = _prompt_logprobs(whole, ids)
    del whole
    chunked = LLM("SmolLM2-135M-Instruct", max_num_batched_tokens=16, **KW)
    b = _prompt_logprobs(chunked, ids)
    ratio = math.exp(-sum(b) / len(b)) / math.exp(-sum(a) / len(a))
    mean_diff = sum(abs(x - y) for x, y in zip(a, b)) / len(a)
    print(f"chunked vs one step: perplexity ratio {ratio:.5f}, mean |dlogprob| {mean_diff:.4f}")
    assert abs(ratio - 1) < 0.01 and mean_diff < 0.1
    monkeypatch.setattr(gq, "INTDOT", False)  # float activations: last-bit differences only
    c = _prompt_logprobs(chunked, ids)
    del chunked
    f_whole = LLM("SmolLM2-135M-Instruct", max_num_batched_tokens=512, **KW)
    d = _prompt_logprobs(f_whole, ids)
    assert max(abs(x - y) for x, y in zip(c, d)) < 1e-4
