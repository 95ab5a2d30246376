"""Speculative decoding through the engine on a tiny random Llama: greedy outputs equal the
non-speculative engine's exactly (alone, batched, chunked prefill, forced preemption), stops and
max_tokens inside accepted runs, KV rollback, verified-only prefix-cache hashes."""
import pytest
import torch

from pagedllm import LLM, SamplingParams

from spec_helpers import tiny_prompts

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "disable_by_batch_size": 0},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 12,
               "disable_by_batch_size": 0},
}
KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


def make(path, spec=None, **kw):
    return LLM(path, speculative_config=spec, **{**KW, **kw})


def run(llm, prompts, sp, one_by_one=False):
    if one_by_one:
        return [llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    return llm.generate(prompts, sp, use_tqdm=False)


@pytest.fixture(scope="module")
def base_llm(tiny_llama_dir):
    return make(tiny_llama_dir)


def stats(llm):
    return llm.llm_engine.core.scheduler.spec_stats


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equal_alone_and_batched(tiny_llama_dir, base_llm, method):
    prompts = tiny_prompts(16)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
    ref = run(base_llm, prompts, sp)
    spec = make(tiny_llama_dir, METHODS[method])
    for one in (True, False):
        got = run(spec, prompts[:8] if one else prompts, sp, one_by_one=one)
        for r, g in zip(ref, got):
            assert g.outputs[0].token_ids == r.outputs[0].token_ids
            for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    st = stats(spec)
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equal_with_chunked_prefill_and_preemption(tiny_llama_dir, method):
    prompts = tiny_prompts(16, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    # 16-token budget: prompts are chunked and verification steps compete for the budget; a
    # 40-block cache of 4-token blocks cannot hold 16 requests: preemption.
    kw = dict(max_num_batched_tokens=16, block_size=4, kv_cache_memory=40 * 4 * 2 * 2 * 2 * 16 * 4,
              enable_prefix_caching=False, max_model_len=128)
    ref = run(make(tiny_llama_dir, **kw), prompts, sp)
    spec = make(tiny_llama_dir, METHODS[method], **kw)
    got = run(spec, prompts, sp)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    assert spec.llm_engine.core.scheduler.num_preemptions_total > 0
    assert stats(spec).num_accepted_tokens > 0


def test_stops_and_max_tokens_inside_accepted_runs(tiny_llama_dir, base_llm):
    prompts = tiny_prompts(4, seed=2)
    free = run(base_llm, prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    spec = make(tiny_llama_dir, METHODS["ngram"])
    tok = spec.get_tokenizer()
    cases = []
    for p, f in zip(prompts, free):
        ids = f.outputs[0].token_ids
        for cut in range(3, 40, 3):
            cases.append((p, SamplingParams(temperature=0.0, max_tokens=cut, ignore_eos=True)))
            cases.append((p, SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[ids[cut]])))
            word = tok.decode([ids[cut]])
            cases.append((p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[word])))
    ps, sps = [c[0] for c in cases], [c[1] for c in cases]
    ref = base_llm.generate(ps, sps, use_tqdm=False)
    got = spec.generate(ps, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].text == r.outputs[0].text
        assert g.outputs[0].finish_reason == r.outputs[0].finish_reason
        assert g.outputs[0].stop_reason == r.outputs[0].stop_reason
    st = stats(spec)
    # Runs of accepted drafts were long enough for stops to land inside them.
    assert sum(st.num_accepted_tokens_per_pos[1:]) > 20


def test_eos_inside_an_accepted_run(tiny_llama_dir, base_llm):
    """EOS is a token like any other for the drafts: make token ids[cut] the EOS via a stop id
    list (EOS handling shares the path) and check min_tokens gating too."""
    prompts = tiny_prompts(3, seed=3)
    free = run(base_llm, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    spec = make(tiny_llama_dir, METHODS["ngram"])
    ps, sps = [], []
    for p, f in zip(prompts, free):
        ids = f.outputs[0].token_ids
        for cut in (5, 11, 17, 23):
            ps.append(p)
            sps.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[cut]], min_tokens=cut))
    ref = base_llm.generate(ps, sps, use_tqdm=False)
    got = spec.generate(ps, sps, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]


def _kv_at(core, req, n):
    """float32 [layers, n, 2, heads, dim]: the request's K/V at positions 0..n-1."""
    bs = core.block_size
    blocks = core.kv_cache_manager.req_to_block_ids[req.request_id]
    pos = torch.arange(n)
    blk = torch.tensor(blocks)[pos // bs]
    return torch.stack([c[blk, :, pos % bs] for c in core.runner.kv_caches]).float()


def test_kv_rollback_matches_non_speculative_cache(tiny_llama_dir):
    prompt = tiny_prompts(1, seed=4)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engines = {}
    for name, spec in (("base", None), ("ngram", METHODS["ngram"])):
        llm = make(tiny_llama_dir, spec, block_size=4)
        eng = llm.llm_engine
        eng.add_request("r", prompt, sp)
        req = eng.core.scheduler.requests["r"]
        seen = {}
        while eng.has_unfinished_requests() and req.num_output_tokens < 50:
            eng.step()
            # Snapshot the cache at every step: verified positions only.
            seen[req.num_computed_tokens] = _kv_at(eng.core, req, req.num_computed_tokens)
            if name == "ngram":
                mgr = eng.core.kv_cache_manager
                assert len(req.block_hashes) <= req.num_tokens // 4
                held = mgr.req_to_blocks["r"]
                for i, b in enumerate(held):
                    if b.block_hash is not None:
                        assert b.block_hash == req.block_hashes[i]  # only verified tokens hashed
        engines[name] = seen
    common = sorted(set(engines["base"]) & set(engines["ngram"]))
    assert len(common) >= 5
    for n in common:
        torch.testing.assert_close(engines["ngram"][n], engines["base"][n], atol=1e-5, rtol=1e-5)


def test_invalid_config_is_a_value_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make(tiny_llama_dir, {"method": "ngram"})
    with pytest.raises(ValueError, match="method"):
        make(tiny_llama_dir, {"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown field .lookup."):
        make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 2, "lookup": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                              "prompt_lookup_max": 2})
