"""LoRA through the offline ``LLM`` on a tiny random Llama checkpoint, against transformers + peft:
greedy tokens identical and their logprobs within 1e-4 for each adapter and for batches mixing
adapters with the base; no prefix-cache sharing across adapters; preemption and chunked prefill
keep the adapter; bad adapters and disabled LoRA are clear errors that add nothing."""
from __future__ import annotations

import pytest

from lora_helpers import peft_greedy
from pagedllm import LLM, LoRARequest, SamplingParams

N = 8
PROMPTS = [[1, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 5], [1, 44, 12, 90, 6, 33, 71, 8],
           [1, 200, 150, 3, 77, 19, 250, 4, 8, 100, 11, 13, 15, 17, 19, 21, 23, 25, 27]]
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)


def _llm(path, **kw):
    kw.setdefault("max_loras", 4)
    kw.setdefault("max_lora_rank", 8)
    kw.setdefault("kv_cache_memory", 8 * 1024**2)
    return LLM(path, dtype="float32", enable_lora=True, num_threads=1, seed=0, **kw)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt[0])


@pytest.fixture(scope="module")
def refs(ckpt):
    """{(prompt index, adapter name or None): (tokens, logprobs)} from transformers + peft."""
    _, hf, adapters = ckpt
    out = {}
    for i, p in enumerate(PROMPTS):
        for name in (None, "a1", "a2", "a3"):
            out[(i, name)] = peft_greedy(hf, None if name is None else adapters[name], p, N)
    return out


def _lr(adapters, name, i):
    return None if name is None else LoRARequest(name, i, adapters[name])


def _check(out, ref):
    toks = list(out.outputs[0].token_ids)
    assert toks == ref[0]
    lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
           for d, t in zip(out.outputs[0].logprobs, toks)]
    assert max(abs(a - b) for a, b in zip(lps, ref[1])) < 1e-4, (lps, ref[1])


def test_each_adapter_alone_matches_peft(llm, ckpt, refs):
    _, _, adapters = ckpt
    for k, name in enumerate(("a1", "a2", "a3")):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                            lora_request=_lr(adapters, name, k + 1))
        for i, o in enumerate(outs):
            _check(o, refs[(i, name)])
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for i, o in enumerate(base):
        _check(o, refs[(i, None)])
    assert len({tuple(refs[(0, n)][0]) for n in (None, "a1", "a2", "a3")}) == 4  # adapters change the text


def test_batch_mixing_three_adapters_and_the_base(llm, ckpt, refs):
    _, _, adapters = ckpt
    plan = [(i, name) for name in (None, "a1", "a2", "a3") for i in range(len(PROMPTS))]
    ids = {"a1": 1, "a2": 2, "a3": 3}
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i, _ in plan], GREEDY, use_tqdm=False,
                        lora_request=[_lr(adapters, n, ids.get(n, 1)) for _, n in plan])
    for (i, name), o in zip(plan, outs):
        _check(o, refs[(i, name)])


def test_prefix_cache_is_not_shared_across_adapters(llm, ckpt):
    _, _, adapters = ckpt
    prompt = {"prompt_token_ids": list(range(3, 40))}  # 37 tokens: two full 16-token blocks
    one = SamplingParams(temperature=0, max_tokens=1)
    a, b = _lr(adapters, "a4", 4), _lr(adapters, "a2", 2)
    llm.reset_prefix_cache()
    assert llm.generate(prompt, one, use_tqdm=False, lora_request=a)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, use_tqdm=False, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(prompt, one, use_tqdm=False, lora_request=a)[0].num_cached_tokens == 32
    assert llm.generate(prompt, one, use_tqdm=False, lora_request=b)[0].num_cached_tokens == 32
    assert llm.generate(prompt, one, use_tqdm=False)[0].num_cached_tokens == 32


def test_preemption_chunked_prefill_and_one_slot_keep_each_adapter(ckpt, refs):
    """One adapter slot, a token budget of 8 (every prompt chunked) and a KV cache of 8 usable blocks
    of 4 tokens for 8 requests: requests wait for the slot, are preempted and recomputed; every
    output is still its adapter's."""
    path, _, adapters = ckpt
    bytes_per_block = 2 * 3 * 2 * 16 * 4 * 4  # K/V x layers x kv heads x head dim x fp32 x block
    llm = _llm(path, max_loras=1, max_cpu_loras=2, block_size=4, max_num_batched_tokens=8,
               kv_cache_memory=9 * bytes_per_block, max_model_len=32)
    plan = [(i, name) for name in ("a1", None, "a2", "a3") for i in range(len(PROMPTS) - 1)]
    ids = {"a1": 1, "a2": 2, "a3": 3}
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i, _ in plan], GREEDY, use_tqdm=False,
                        lora_request=[_lr(adapters, n, ids.get(n, 1)) for _, n in plan])
    for (i, name), o in zip(plan, outs):
        _check(o, refs[(i, name)])
    sched = llm.llm_engine.core.scheduler
    assert sched.num_preemptions_total > 0
    stats = llm.llm_engine.core.runner.lora_manager.stats()
    assert stats["max_loras"] == 1 and stats["cpu_cache_adapters"] <= 2 and stats["loads"] >= 3


def test_add_remove_list(llm, ckpt):
    _, _, adapters = ckpt
    a = LoRARequest("a4", 40, adapters["a4"])
    assert llm.add_lora(a) is True
    assert 40 in llm.list_loras()
    assert llm.add_lora(a) is False  # cached
    assert llm.remove_lora(40) is True and 40 not in llm.list_loras()
    assert llm.remove_lora(40) is False
    # a removed adapter is loaded again by its next request
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False, lora_request=a)
    assert len(out[0].outputs[0].token_ids) == 2 and 40 in llm.list_loras()


def test_bad_adapter_is_a_clear_error_and_adds_nothing(llm, ckpt, tmp_path):
    _, _, adapters = ckpt
    bad = LoRARequest("nowhere", 50, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"'nowhere'.*No adapter found.*\(prompt index 1\)"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, use_tqdm=False,
                     lora_request=[None, bad])
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_request: got 1 for 2 prompts"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, use_tqdm=False, lora_request=[None])
    big = LoRARequest("too-big", 51, adapters["a1"])
    small = _llm(ckpt[0], max_lora_rank=4, max_loras=1)
    with pytest.raises(ValueError, match="'too-big'.*rank 8, over max_lora_rank 4"):
        small.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=big)


def test_lora_needs_enable_lora(ckpt):
    path, _, adapters = ckpt
    plain = LLM(path, dtype="float32", kv_cache_memory=4 * 1024**2, num_threads=1)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("a1", 1, adapters["a1"]))
    with pytest.raises(ValueError, match="max_cpu_loras: must be >= max_loras"):
        LLM(path, dtype="float32", enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank: must be an integer >= 1"):
        LLM(path, dtype="float32", enable_lora=True, max_lora_rank=0)


def test_worker_in_another_process(ckpt, refs, tmp_path):
    """The "mp" executor (the worker in a spawned process): adapters are loaded there through
    collective_rpc, requests carry them over the wire codec, errors come back as ValueErrors."""
    path, _, adapters = ckpt
    llm = _llm(path, max_loras=2, distributed_executor_backend="mp")
    try:
        plan = [(0, "a1"), (1, None), (2, "a3"), (1, "a1")]
        ids = {"a1": 1, "a3": 3}
        outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i, _ in plan], GREEDY, use_tqdm=False,
                            lora_request=[_lr(adapters, n, ids.get(n, 1)) for _, n in plan])
        for (i, name), o in zip(plan, outs):
            _check(o, refs[(i, name)])
        assert llm.list_loras() == {1, 3}
        with pytest.raises(ValueError, match="'ghost'.*No adapter found"):
            llm.add_lora(LoRARequest("ghost", 9, str(tmp_path / "ghost")))
        outs = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                            lora_request=_lr(adapters, "a2", 2))
        _check(outs[0], refs[(0, "a2")])
    finally:
        llm.shutdown()


def test_cpu_cache_bound_prefers_adapters_not_in_use(ckpt, refs):
    path, _, adapters = ckpt
    llm = _llm(path, max_loras=1, max_cpu_loras=2)
    core = llm.llm_engine.core
    for k, name in enumerate(("a1", "a2", "a3", "a1")):
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                           lora_request=_lr(adapters, name, k % 3 + 1))
        _check(out[0], refs[(0, name)])
        assert len(core.loras) <= 2 and set(core.loras) == llm.list_loras()
    assert list(core.loras) == [3, 1]  # a2 (least recently used) went first
    # three adapters queued at once with room for two: the one not in use is evicted first
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=2)
    for rid, (name, lid) in enumerate((("a3", 3), ("a2", 2))):
        eng.add_request(f"q{rid}", {"prompt_token_ids": PROMPTS[1]}, sp, lora_request=_lr(adapters, name, lid))
    assert list(core.loras) == [3, 2]  # a1 was not in use
    while eng.has_unfinished_requests():
        eng.step()


def test_speculative_decoding_with_adapters_keeps_peft_greedy(ckpt):
    """n-gram speculative decoding on a LoRA engine: drafts are verified through the adapters'
    forward (in steps beside chunked prefills too), so a batch mixing adapters and the base gives
    transformers + peft's greedy tokens; drafts were proposed and some accepted."""
    path, hf, adapters = ckpt
    loop = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # repeats: the n-gram proposer drafts
    prompts = [loop, PROMPTS[0]]
    names = (None, "a1", "a3")
    ids = {"a1": 1, "a3": 3}
    refs = {(i, n): peft_greedy(hf, None if n is None else adapters[n], p, N)
            for i, p in enumerate(prompts) for n in names}
    # NOTE: a small token budget: later prompts prefill in chunks while earlier ones verify drafts
    llm = _llm(path, max_num_batched_tokens=16,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 1, "disable_by_batch_size": 0})
    plan = [(i, n) for n in names for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i, _ in plan], GREEDY, use_tqdm=False,
                        lora_request=[_lr(adapters, n, ids.get(n, 1)) for _, n in plan])
    for (i, name), o in zip(plan, outs):
        assert list(o.outputs[0].token_ids) == refs[(i, name)][0], (i, name)
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, (st.num_drafts, st.num_accepted_tokens)
