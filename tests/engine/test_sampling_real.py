"""Sampling parameters end to end through ``LLM.generate`` on the real SmolLM2 (fp32).

Logprob tolerance: our logits equal transformers' on the same fp32 weights to ~1e-4 or better (see
tests/models/test_real_parity.py), and decode steps read K/V from the paged cache instead of recomputing,
so a log_softmax value may differ by a few 1e-4 at most; LP_ATOL = 2e-3 keeps headroom while a wrong
position (off by one) or a post-temperature / post-penalty distribution would differ by >= 1e-1.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams

pytestmark = pytest.mark.slow

LP_ATOL = 2e-3
STORY = "Once upon a time, in a small village by the sea,"
# Greedy (fp32): " there was a wise old wizard named Thorold. He lived in a tower surrounded by a beautiful ..."
YES_NO = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]  # greedy: "No" + EOS
EOS = 2


def _gen(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def story_greedy(smollm2_llm):
    """(token ids, text) of the greedy continuation of STORY (24 tokens)."""
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24).outputs[0]
    assert c.text.startswith(" there was a wise old wizard named Thor"), c.text  # the stop tests rely on it
    return c.token_ids, c.text


def _ref_logprobs(hf_smollm2, ids):
    model, _ = hf_smollm2
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


# ---------------------------------------------------------------- logprobs


def test_logprobs_match_reference(smollm2_llm, hf_smollm2, story_greedy):
    tok = smollm2_llm.get_tokenizer()
    out = _gen(smollm2_llm, STORY, temperature=0, logprobs=5, max_tokens=8)
    c = out.outputs[0]
    assert c.token_ids == story_greedy[0][:8]
    P = len(out.prompt_token_ids)
    ref = _ref_logprobs(hf_smollm2, out.prompt_token_ids + c.token_ids)
    assert c.logprobs is not None and len(c.logprobs) == 8
    max_diff = 0.0
    for i, (tid, pos) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[P - 1 + i]
        assert tid in pos and pos[tid].rank == 1  # greedy: the sampled token is the argmax
        assert len(pos) == 5  # the sampled token is also the top-1 entry: 5 distinct ids
        top = sorted(pos.items(), key=lambda kv: kv[1].rank)
        assert [lp.rank for _, lp in top] == [1, 2, 3, 4, 5]
        assert [t for t, _ in top] == row.topk(5).indices.tolist()
        for t, lp in pos.items():
            max_diff = max(max_diff, abs(lp.logprob - row[t].item()))
            assert lp.logprob == pytest.approx(row[t].item(), abs=LP_ATOL)
            assert lp.decoded_token == tok.decode([t])
        lps = [lp.logprob for _, lp in top]
        assert lps == sorted(lps, reverse=True)
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)),
                                                 abs=1e-4)
    print(f"generated logprobs max |diff| vs transformers: {max_diff:.2e}")


def test_sampled_logprob_rank_when_not_top(smollm2_llm, hf_smollm2):
    """A token forced by logit_bias keeps its RAW logprob and true rank (raw_logprobs mode)."""
    out = _gen(smollm2_llm, STORY, temperature=0, logprobs=2, max_tokens=1, logit_bias={1573: 100})
    c = out.outputs[0]
    assert c.token_ids == [1573]
    row = _ref_logprobs(hf_smollm2, out.prompt_token_ids)[-1]
    lp = c.logprobs[0][1573]
    assert lp.logprob == pytest.approx(row[1573].item(), abs=LP_ATOL)
    assert lp.rank == int((row > row[1573]).sum()) + 1 and lp.rank > 2
    assert len(c.logprobs[0]) == 3


def test_prompt_logprobs_match_reference(smollm2_llm, hf_smollm2):
    out = _gen(smollm2_llm, STORY, temperature=0, prompt_logprobs=3, max_tokens=2)
    ids = out.prompt_token_ids
    ref = _ref_logprobs(hf_smollm2, ids)
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids) and pl[0] is None
    max_diff = 0.0
    for p in range(1, len(ids)):
        d = pl[p]
        assert ids[p] in d
        assert 3 <= len(d) <= 4
        assert d[ids[p]].rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in d.items() if t != ids[p] or lp.rank <= 3)
        assert [r for r, _ in top][:3] == [1, 2, 3]
        for t, lp in d.items():
            max_diff = max(max_diff, abs(lp.logprob - ref[p - 1, t].item()))
            assert lp.logprob == pytest.approx(ref[p - 1, t].item(), abs=LP_ATOL)
    print(f"prompt logprobs max |diff| vs transformers: {max_diff:.2e}")


# ---------------------------------------------------------------- randomness


def test_top_k_1_equals_greedy(smollm2_llm, story_greedy):
    c = _gen(smollm2_llm, STORY, temperature=1.0, top_k=1, max_tokens=24).outputs[0]
    assert c.token_ids == story_greedy[0]


def test_seed_reproducible_alone_and_in_batch(smollm2_llm):
    kw = dict(temperature=1.0, max_tokens=16)
    alone = _gen(smollm2_llm, STORY, seed=1234, **kw).outputs[0]
    prompts = ["The quick brown fox", STORY, STORY, "def f(x):", STORY, STORY]
    params = [SamplingParams(**kw), SamplingParams(seed=1234, **kw), SamplingParams(seed=99, **kw),
              SamplingParams(seed=1234, **kw), SamplingParams(**kw), SamplingParams(seed=1234, **kw)]
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone.token_ids and outs[1].outputs[0].text == alone.text
    assert outs[5].outputs[0].token_ids == alone.token_ids
    # a different seed / no seed gives another sample (16 tokens at T=1: equal only by a freak chance)
    assert outs[2].outputs[0].token_ids != alone.token_ids
    assert outs[4].outputs[0].token_ids != alone.token_ids


def test_n4_samples(smollm2_llm):
    out = _gen(smollm2_llm, STORY, n=4, temperature=1.0, max_tokens=12)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) >= 1 and c.finish_reason in ("stop", "length") for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # seeded n=4: reproducible as a whole
    a = _gen(smollm2_llm, STORY, n=4, temperature=1.0, max_tokens=8, seed=7)
    b = _gen(smollm2_llm, STORY, n=4, temperature=1.0, max_tokens=8, seed=7)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_n4_shares_prompt_blocks(smollm2_llm):
    eng = smollm2_llm.llm_engine
    kvm = eng.core.kv_cache_manager
    assert kvm.usage == 0 and not eng.has_unfinished_requests()
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # 40 tokens: 2 full blocks + 8
    eng.add_request("n4-share", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=3))
    eng.step()
    tables = [kvm.get_block_ids(f"{i}_n4-share") for i in range(4)]
    assert all(len(t) == 3 for t in tables)
    # the 2 full prompt blocks are one pair of blocks held by all 4 samples; the partial last block is private
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert [kvm.block_pool.blocks[b].ref_cnt for b in tables[0][:2]] == [4, 4]
    assert len({t[2] for t in tables}) == 4 and all(kvm.block_pool.blocks[t[2]].ref_cnt == 1 for t in tables)
    kvm.check_invariants()
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final = o
    assert final is not None and final.request_id == "n4-share" and len(final.outputs) == 4
    assert final.num_cached_tokens == 32
    assert kvm.usage == 0
    kvm.check_invariants()


# ---------------------------------------------------------------- stopping


def test_stop_strings(smollm2_llm, story_greedy):
    ids, text = story_greedy
    tok = smollm2_llm.get_tokenizer()
    # spans tokens " wise" + " old"
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop="wise old").outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" there was a ", "stop", "wise old")
    assert c.token_ids == ids[:5]
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop="wise old",
             include_stop_str_in_output=True).outputs[0]
    assert (c.text, c.stop_reason) == (" there was a wise old", "wise old")
    # starts in the middle of the token "izard" and ends inside " named"
    assert tok.decode(ids[5:8]) == " wizard named"
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop=["zard nam"]).outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" there was a wise old wi", "stop", "zard nam")
    assert c.token_ids == ids[:8]
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop=["zard nam"],
             include_stop_str_in_output=True).outputs[0]
    assert c.text == " there was a wise old wizard nam" and c.token_ids == ids[:8]


def test_multiple_stop_strings_earliest_wins(smollm2_llm, story_greedy):
    # list order does not matter: "old" completes before "wizard"
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop=["wizard", "tower", "old"]).outputs[0]
    assert (c.text, c.stop_reason) == (" there was a wise ", "old")
    # both complete inside the same token "izard": the one ending first ("zar") wins
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop=["izard", "zar"]).outputs[0]
    assert (c.text, c.stop_reason) == (" there was a wise old wi", "zar")


def test_stop_token_ids(smollm2_llm, story_greedy):
    ids, _ = story_greedy
    tok = smollm2_llm.get_tokenizer()
    stop_id = ids[3]  # " wise"
    assert stop_id not in ids[:3]
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, stop_token_ids=[stop_id]).outputs[0]
    assert c.token_ids == ids[:4]  # the (non-special) stop token is kept in token_ids
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == tok.decode(ids[:3])  # ... but not in the text (vLLM)
    # EOS: finish "stop" with stop_reason None
    out = smollm2_llm.chat(YES_NO, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == EOS and (out.finish_reason, out.stop_reason) == ("stop", None)


def test_min_tokens(smollm2_llm, story_greedy):
    base = smollm2_llm.chat(YES_NO, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert len(base.token_ids) <= 3 and base.token_ids[-1] == EOS  # ends almost immediately
    c = smollm2_llm.chat(YES_NO, SamplingParams(temperature=0, max_tokens=10, min_tokens=6),
                         use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 6 and EOS not in c.token_ids[:6]
    assert c.token_ids[:len(base.token_ids) - 1] == base.token_ids[:-1]
    # min_tokens also masks stop_token_ids
    ids, _ = story_greedy
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=8, stop_token_ids=[ids[0]]).outputs[0]
    assert c.token_ids == ids[:1]
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=8, stop_token_ids=[ids[0]], min_tokens=3).outputs[0]
    assert len(c.token_ids) >= 3 and ids[0] not in c.token_ids[:3]


def test_ignore_eos(smollm2_llm):
    c = smollm2_llm.chat(YES_NO, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length" and c.stop_reason is None
    assert c.token_ids[1] == EOS  # EOS is generated (greedy) but does not stop


def test_max_tokens_length(smollm2_llm, story_greedy):
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=5).outputs[0]
    assert c.token_ids == story_greedy[0][:5] and (c.finish_reason, c.stop_reason) == ("length", None)


# ---------------------------------------------------------------- logits processors


def test_logit_bias_forces_token(smollm2_llm):
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=4, logit_bias={1573: 100}).outputs[0]
    assert c.token_ids == [1573] * 4
    c = _gen(smollm2_llm, STORY, temperature=0.8, seed=3, max_tokens=4, logit_bias={"1573": 100}).outputs[0]
    assert c.token_ids == [1573] * 4


def test_allowed_token_ids(smollm2_llm, story_greedy):
    allowed = [260, 3003, 4683, 282, 2380, 30, 28]  # the primary colors of the RGB color . ,
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        c = _gen(smollm2_llm, STORY, max_tokens=8, allowed_token_ids=allowed, **kw).outputs[0]
        assert len(c.token_ids) == 8 and set(c.token_ids) <= set(allowed), c.token_ids


def test_bad_words(smollm2_llm, story_greedy):
    _, text = story_greedy
    assert "wise" in text and "tower" in text
    c = _gen(smollm2_llm, STORY, temperature=0, max_tokens=24, bad_words=["wise", "tower"]).outputs[0]
    assert "wise" not in c.text and "tower" not in c.text, c.text
    assert c.text != text


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=-1), "logprobs"),
])
def test_invalid_params_raise(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_invalid_against_model_then_still_works(smollm2_llm, story_greedy):
    llm = smollm2_llm
    bad = [
        (dict(logprobs=21), "logprobs"),  # > max_logprobs (20)
        (dict(prompt_logprobs=50), "prompt_logprobs"),
        (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(stop_token_ids=[49152]), "stop_token_ids"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=field):
            llm.generate([STORY, "Hello"], SamplingParams(temperature=0, max_tokens=4, **kw), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.core.kv_cache_manager.usage == 0
    c = _gen(llm, STORY, temperature=0, max_tokens=24).outputs[0]
    assert c.token_ids == story_greedy[0]


# ---------------------------------------------------------------- more edge cases


def test_logprobs_zero_raw_mode_and_no_detokenize(smollm2_llm, hf_smollm2):
    # logprobs=0: only the sampled token; at temperature 0.5 the logprobs are still the RAW distribution's
    out = _gen(smollm2_llm, STORY, temperature=0.5, seed=11, logprobs=0, max_tokens=6)
    c = out.outputs[0]
    ref = _ref_logprobs(hf_smollm2, out.prompt_token_ids + c.token_ids)
    P = len(out.prompt_token_ids)
    for i, (t, pos) in enumerate(zip(c.token_ids, c.logprobs)):
        assert list(pos) == [t]
        assert pos[t].logprob == pytest.approx(ref[P - 1 + i, t].item(), abs=LP_ATOL)
        assert pos[t].rank == int((ref[P - 1 + i] > ref[P - 1 + i, t]).sum()) + 1
    # detokenize=False: no text, no decoded tokens, same ids
    d = _gen(smollm2_llm, STORY, temperature=0.5, seed=11, logprobs=0, max_tokens=6, detokenize=False).outputs[0]
    assert d.token_ids == c.token_ids and d.text == ""
    assert all(lp.decoded_token is None for pos in d.logprobs for lp in pos.values())


def test_truncation_knobs_equal_greedy(smollm2_llm, story_greedy):
    for kw in (dict(top_p=1e-4), dict(min_p=1.0), dict(top_k=1, top_p=0.5)):
        c = _gen(smollm2_llm, STORY, temperature=1.0, seed=1, max_tokens=24, **kw).outputs[0]
        assert c.token_ids == story_greedy[0], kw


def test_repetition_penalty_matches_transformers(smollm2_llm, hf_smollm2):
    # transformers' RepetitionPenaltyLogitsProcessor, like vLLM, penalizes prompt AND output tokens
    model, tok = hf_smollm2
    prompt = "The cat sat on the mat. The cat sat on the"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                             pad_token_id=0)[0, ids.shape[1]:].tolist()
    c = _gen(smollm2_llm, prompt, temperature=0, max_tokens=16, repetition_penalty=1.5).outputs[0]
    assert c.token_ids[:len(ref)] == ref
    plain = _gen(smollm2_llm, prompt, temperature=0, max_tokens=16).outputs[0]
    assert plain.token_ids != c.token_ids


def test_n2_prompt_logprobs_and_stop(smollm2_llm, story_greedy):
    out = _gen(smollm2_llm, STORY, n=2, temperature=0, max_tokens=24, prompt_logprobs=1, stop="wizard")
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for c in out.outputs:
        assert (c.text, c.finish_reason, c.stop_reason) == (" there was a wise old ", "stop", "wizard")
