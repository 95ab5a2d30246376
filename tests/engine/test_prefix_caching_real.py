"""Prefix caching on the real SmolLM2 (fp32) through the public LLM: greedy outputs with the cache on equal
those with it off (also with a KV cache so small that cached blocks are evicted and requests preempted), and
``RequestOutput.num_cached_tokens`` is exact (block_size 16: hits are whole blocks, capped below the prompt
length so at least one token is computed)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


#: like with like against dequantized float32 references (tests/conftest.py _gguf_float_activations)
GGUF_FLOAT_ACTIVATIONS = True


GREEDY = SamplingParams(temperature=0, max_tokens=12)
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2 fp32: layers * kv_heads * head_dim * K/V * 4 B * 16 tokens

SYSTEM = ("You are a meticulous assistant for a public library. You answer questions about books, authors, "
          "opening hours and borrowing rules. Keep every answer short, polite and factual, and never invent "
          "titles that do not exist. The library opens at nine and closes at six on weekdays.")
QUESTIONS = ["Who wrote Pride and Prejudice?", "When does the library close on Tuesday?",
             "Can I borrow ten books at once?"]
LONG_TEXT = ("The river wound slowly through the valley, past orchards heavy with apples and fields of golden "
             "wheat, until it reached the old stone bridge where the children of the village gathered every "
             "evening to watch the swallows dive and skim the water before the sun went down")


@pytest.fixture(scope="module")
def llm_off():
    return LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=64 * 1024**2,
               max_num_batched_tokens=512, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm_tiny():
    # 12 blocks (11 usable = 176 tokens) for batches of ~100-token prompts: cached blocks are evicted and
    # running requests preempted; a token budget of 32 also chunks every prefill.
    return LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=12 * BYTES_PER_BLOCK,
               max_model_len=160, max_num_batched_tokens=32, enable_prefix_caching=True)


def _toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def _chat_prompts(llm, convs):
    return [llm.llm_engine_apply_chat_template(c) for c in convs]


def _scenarios(llm):
    """Prompt lists (each run as one batch, in order, so later ones can hit earlier ones' blocks)."""
    tok = llm.get_tokenizer()
    sys_convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    long_ids = tok(LONG_TEXT).input_ids
    assert len(long_ids) >= 50
    prefixes = [{"prompt_token_ids": long_ids[:n]} for n in (16, 33, 48, len(long_ids))]
    return [
        ("system prompt, one by one", _chat_prompts(llm, sys_convs[:1])),
        ("system prompt, one by one", _chat_prompts(llm, sys_convs[1:2])),
        ("system prompt, batch", _chat_prompts(llm, sys_convs)),
        ("exact prefixes, batch", prefixes),
        ("exact prefixes, reversed, one by one", prefixes[3:]),
        ("exact prefixes, reversed, one by one", prefixes[2:3]),
        ("exact prefixes, reversed, one by one", prefixes[1:2]),
        ("exact prefixes, reversed, one by one", prefixes[:1]),
        ("repeat of a cached prompt", prefixes[3:] + _chat_prompts(llm, sys_convs[:1])),
    ]


def _multi_turn(llm):
    """Turn 1, then turn 2 whose prompt contains turn 1 (prompt + reply). Returns (outs1, outs2)."""
    conv = [{"role": "user", "content": "Name a fruit that is yellow."}]
    o1 = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    conv2 = conv + [{"role": "assistant", "content": o1.outputs[0].text},
                    {"role": "user", "content": "And one that is red? Answer in one sentence."}]
    o2 = llm.chat(conv2, GREEDY, use_tqdm=False)[0]
    return o1, o2


@pytest.fixture(scope="module")
def reference(llm_off):
    ref = [_toks(llm_off.generate(ps, GREEDY, use_tqdm=False)) for _, ps in _scenarios(llm_off)]
    o1, o2 = _multi_turn(llm_off)
    assert o2.num_cached_tokens == 0
    return ref, (o1.outputs[0].token_ids, o2.outputs[0].token_ids)


@pytest.mark.parametrize("which", ["smollm2_llm", "llm_tiny"])
def test_outputs_identical_with_and_without_prefix_caching(which, request, reference):
    llm = request.getfixturevalue(which)
    ref, (ref1, ref2) = reference
    assert llm.reset_prefix_cache()
    hits = []
    for (name, prompts), want in zip(_scenarios(llm), ref):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert _toks(outs) == want, name
        hits.append((name, [o.num_cached_tokens for o in outs]))
    o1, o2 = _multi_turn(llm)
    assert (o1.outputs[0].token_ids, o2.outputs[0].token_ids) == (ref1, ref2)
    core = llm.llm_engine.core
    assert core.kv_cache_manager.usage == 0
    core.kv_cache_manager.check_invariants()
    if which == "smollm2_llm":
        # the cache was really used: repeats hit, and turn 2 reuses turn 1's prompt blocks (at least)
        assert hits[-1][1][0] > 0 and hits[-1][1][1] > 0, hits
        assert hits[1][1][0] > 0  # the shared system prompt
        assert o2.num_cached_tokens >= 16 * (len(o1.prompt_token_ids) // 16) > 0
    else:
        assert core.scheduler.num_preemptions_total > 0
    print(which, hits, "turn 2 cached:", o2.num_cached_tokens)


# ---------------------------------------------------------------- num_cached_tokens


def _ids(start, n):
    # distinct ordinary-word token ids, unlikely to be cached by another test
    return {"prompt_token_ids": list(range(start, start + n))}


def _cached(llm, prompt, **kw):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, **kw), use_tqdm=False)[0]
    return out.num_cached_tokens


def test_num_cached_tokens_exact(smollm2_llm):
    llm = smollm2_llm
    assert llm.reset_prefix_cache()
    p40, p48, p49 = _ids(7000, 40), _ids(8000, 48), _ids(8000, 49)
    assert _cached(llm, p40) == 0
    assert _cached(llm, p40) == 32  # 2 full blocks; the partial third is never cached
    assert _cached(llm, p48) == 0
    # fully cached and block-aligned: the last block is recomputed so a logit comes out
    assert _cached(llm, p48) == 32
    assert _cached(llm, p49) == 48  # extends p48 by one token: all 3 blocks hit
    assert _cached(llm, _ids(8000, 20)) == 16  # a prefix of a cached prompt
    assert _cached(llm, _ids(8000, 16)) == 0  # one block only: capped below 16
    # prompt logprobs need every position: no hit
    assert _cached(llm, p40, prompt_logprobs=1) == 0
    # generated tokens fill cacheable blocks too: prompt 30 + 10 generated -> tokens 0..38 computed
    p30 = _ids(9000, 30)
    out = llm.generate(p30, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    follow = {"prompt_token_ids": p30["prompt_token_ids"] + out.outputs[0].token_ids + [9500]}
    assert _cached(llm, follow) == 32
    # reset drops every hash
    assert llm.reset_prefix_cache()
    assert _cached(llm, p40) == 0 and _cached(llm, p49) == 0
    assert llm.llm_engine.core.kv_cache_manager.usage == 0


def test_cache_salt_isolates(smollm2_llm):
    llm = smollm2_llm
    assert llm.reset_prefix_cache()
    ids = _ids(10000, 40)["prompt_token_ids"]
    a = {"prompt_token_ids": ids, "cache_salt": "tenant-a"}
    b = {"prompt_token_ids": ids, "cache_salt": "tenant-b"}
    plain = {"prompt_token_ids": ids}
    assert [_cached(llm, p) for p in (a, b, plain)] == [0, 0, 0]
    assert [_cached(llm, p) for p in (a, b, plain)] == [32, 32, 32]
    # the salt is mixed into the first block only, but later blocks chain on it: nothing is shared
    c = {"prompt_token_ids": ids, "cache_salt": "tenant-c"}
    outs = llm.generate([c, a], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 32]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == llm.generate(plain, SamplingParams(temperature=0, max_tokens=6),
                                                        use_tqdm=False)[0].outputs[0].token_ids


def test_seeded_sampling_survives_eviction_and_preemption(llm_tiny, smollm2_llm):
    """Seeded random samples in a batch that the tiny cache must preempt equal the same requests run with
    ample memory (the per-request generator survives preemption; recomputed prefixes give the same logits)."""
    prompts = [llm_tiny.llm_engine_apply_chat_template([{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": q}]) for q in QUESTIONS]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24) for i in range(3)]
    before = llm_tiny.llm_engine.core.scheduler.num_preemptions_total
    got = _toks(llm_tiny.generate(prompts, params, use_tqdm=False))
    assert llm_tiny.llm_engine.core.scheduler.num_preemptions_total > before
    assert got == _toks(smollm2_llm.generate(prompts, params, use_tqdm=False))


def test_stop_string_in_prompt_does_not_stop(smollm2_llm):
    # both are in the prompt (not in the greedy continuation ".\n\nThe children of the village"): no stop
    stop = ["orchards", "swallows"]
    out = smollm2_llm.generate(LONG_TEXT, SamplingParams(temperature=0, max_tokens=8, stop=stop),
                               use_tqdm=False)[0].outputs[0]
    assert all(s in LONG_TEXT for s in stop)
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and out.text.endswith("village")
