"""Sampler on hand-made logits: every stage removes / changes exactly what its formula says."""
import math

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)
from pagedllm.sampling_params import SamplingParams

torch.set_num_threads(1)
V = 8
NEG_INF = float("-inf")


def meta_for(params, outputs=None, prompts=None, gens=None, eos=None, vocab=V):
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        gens if gens is not None else [None] * n,
        vocab,
        eos,
    )


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def probs_support(logits, params, trials=400, outputs=None):
    """Set of token ids sampled over many trials (one batch of identical rows)."""
    ps = [params] * trials
    meta = meta_for(ps, outputs=outputs * trials if outputs else None)
    out = Sampler()(logits.expand(trials, -1).clone(), meta)
    return set(out.sampled_token_ids.tolist())


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 3.0]])


# ------------------------------------------------------------------ greedy / top-k / p / min-p
def test_greedy_is_argmax_and_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, V)
    greedy = Sampler()(logits, meta_for([SamplingParams(temperature=0.0)] * 16))
    assert torch.equal(greedy.sampled_token_ids, logits.argmax(-1))
    topk1 = Sampler()(logits, meta_for([SamplingParams(temperature=1.3, top_k=1)] * 16))
    assert torch.equal(topk1.sampled_token_ids, greedy.sampled_token_ids)
    assert greedy.sampled_token_ids.dtype == torch.int64
    assert greedy.logprobs is None and greedy.logprob_token_ids is None


def test_sampler_does_not_modify_caller_logits():
    logits = LOGITS.clone()
    Sampler()(logits, meta_for([SamplingParams(top_k=2, repetition_penalty=1.5,
                                               logit_bias={1: 5})], outputs=[[1]]))
    assert torch.equal(logits, LOGITS)


def test_top_k_mask_exact():
    out = apply_top_k_top_p(LOGITS.clone(), torch.tensor([3]), None)
    kept = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert kept == [0, 1, 7]  # the three largest logits: 3.0, 2.0, 1.0
    assert torch.equal(out[0, kept], LOGITS[0, kept])
    # Rows with k >= V untouched, in the same batch.
    two = torch.cat([LOGITS, LOGITS])
    out2 = apply_top_k_top_p(two, torch.tensor([2, V]), None)
    assert torch.isfinite(out2[0]).sum() == 2 and torch.equal(out2[1], LOGITS[0])


def test_top_p_mask_exact():
    p = 0.8
    probs = torch.softmax(LOGITS[0], -1)
    # Formula: sort ascending; drop tokens whose cumulative prob (incl. itself) <= 1 - p.
    order = probs.argsort()
    cum = probs[order].cumsum(0)
    expected_removed = set(order[cum <= 1 - p].tolist())
    assert expected_removed  # the test is meaningful
    out = apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([p]))
    removed = set((~torch.isfinite(out[0])).nonzero().flatten().tolist())
    assert removed == expected_removed
    # Kept tokens still hold mass >= p.
    assert probs[list(set(range(V)) - removed)].sum() >= p
    # Sampling never produces a removed token.
    support = probs_support(LOGITS, SamplingParams(top_p=p))
    assert support.isdisjoint(expected_removed)


def test_top_p_tiny_keeps_the_top_token():
    out = apply_top_k_top_p(LOGITS.clone(), None, torch.tensor([1e-6]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [7]


def test_top_k_and_top_p_together():
    out = apply_top_k_top_p(LOGITS.clone(), torch.tensor([3]), torch.tensor([0.7]))
    # Renormalized over {7: 3.0, 0: 2.0, 1: 1.0}: ascending cum probs.
    p3 = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    cum = p3.cumsum(0)
    expected_kept = {7} | ({0} if cum[1] > 0.3 else set()) | ({1} if cum[0] > 0.3 else set())
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == expected_kept


def test_min_p_mask_exact():
    min_p = 0.2
    probs = torch.softmax(LOGITS[0], -1)
    expected_removed = set((probs < min_p * probs.max()).nonzero().flatten().tolist())
    assert expected_removed and len(expected_removed) < V - 1
    out = apply_min_p(LOGITS.clone(), torch.tensor([min_p]))
    removed = set((~torch.isfinite(out[0])).nonzero().flatten().tolist())
    assert removed == expected_removed
    support = probs_support(LOGITS, SamplingParams(min_p=min_p))
    assert support.isdisjoint(expected_removed)


def test_min_p_after_temperature():
    # temperature 2 flattens the distribution: fewer tokens fall under min_p * max.
    t, min_p = 2.0, 0.2
    probs = torch.softmax(LOGITS[0] / t, -1)
    expected_removed = set((probs < min_p * probs.max()).nonzero().flatten().tolist())
    support = probs_support(LOGITS, SamplingParams(temperature=t, min_p=min_p), trials=800)
    assert support.isdisjoint(expected_removed)
    assert support == set(range(V)) - expected_removed  # everything else shows up


def test_random_sampling_matches_distribution():
    logits = torch.tensor([[0.0, math.log(3.0), NEG_INF, math.log(6.0)]])
    n = 6000
    meta = meta_for([SamplingParams(seed=123)] * 1 + [SamplingParams()] * (n - 1), vocab=4)
    torch.manual_seed(0)
    toks = Sampler()(logits.expand(n, -1).clone(), meta).sampled_token_ids
    freq = torch.bincount(toks, minlength=4).float() / n
    assert freq[2] == 0
    assert torch.allclose(freq, torch.tensor([0.1, 0.3, 0.0, 0.6]), atol=0.03)


# ------------------------------------------------------------------ penalties
def test_repetition_penalty_formula():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 0.0, 3.0, -3.0]])
    r = 2.0
    meta = meta_for([SamplingParams(repetition_penalty=r, temperature=0)],
                    prompts=[[0, 1]], outputs=[[2, 3, 3]])
    out = Sampler().apply_logits_processors(logits.clone(), meta)
    expected = logits.clone()
    for t in (0, 1, 2, 3):  # prompt and output tokens
        expected[0, t] = expected[0, t] / r if expected[0, t] > 0 else expected[0, t] * r
    assert torch.allclose(out, expected)


def test_frequency_and_presence_penalty_formula_output_only():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 0.0, 3.0, -3.0]])
    f, p = 0.5, 0.3
    meta = meta_for([SamplingParams(frequency_penalty=f, presence_penalty=p)],
                    prompts=[[4, 5, 6]], outputs=[[2, 3, 3, 3, 7]])
    out = Sampler().apply_logits_processors(logits.clone(), meta)
    expected = logits.clone()
    counts = {2: 1, 3: 3, 7: 1}
    for t, c in counts.items():
        expected[0, t] -= f * c + p
    # prompt tokens 4, 5, 6 untouched: frequency/presence look at the output only
    assert torch.allclose(out, expected)


def test_penalties_mixed_batch_and_function():
    logits = torch.ones(3, V)
    out = apply_penalties(
        logits.clone(),
        torch.tensor([[1, V], [V, V], [2, 3]]),
        [[0, 0], [5], []],
        presence_penalties=torch.tensor([0.0, 1.0, 0.0]),
        frequency_penalties=torch.tensor([1.0, 0.0, 0.0]),
        repetition_penalties=torch.tensor([1.0, 1.0, 4.0]),
    )
    expected = torch.ones(3, V)
    expected[0, 0] = 1 - 2.0
    expected[1, 5] = 0.0
    expected[2, 2] = expected[2, 3] = 0.25
    assert torch.allclose(out, expected)


# ------------------------------------------------------------------ bias / allowed / bad / min
def test_logit_bias_forces_token():
    torch.manual_seed(0)
    logits = torch.randn(32, V)
    params = [SamplingParams(logit_bias={5: 100})] * 32
    out = Sampler()(logits, meta_for(params))
    assert out.sampled_token_ids.tolist() == [5] * 32
    meta = meta_for([SamplingParams(logit_bias={"2": -3.5, 4: 1.25})])
    lp = Sampler().apply_logits_processors(LOGITS.clone(), meta)
    expected = LOGITS.clone()
    expected[0, 2] -= 3.5
    expected[0, 4] += 1.25
    assert torch.allclose(lp, expected)


def test_allowed_token_ids_restrict():
    params = [SamplingParams(allowed_token_ids=[2, 5])] * 300 + [SamplingParams(temperature=0)]
    logits = LOGITS.expand(301, -1).clone()
    out = Sampler()(logits, meta_for(params)).sampled_token_ids
    assert set(out[:300].tolist()) == {2, 5}
    assert out[300].item() == 7  # unrestricted row in the same batch


def test_bad_words_banned():
    p = SamplingParams(temperature=0)
    p._bad_words_token_ids = [[7], [3, 4, 0]]
    # [7] always banned; 0 banned only after output tail [3, 4].
    meta = meta_for([p, p, p], outputs=[[1], [9 % V, 3, 4], [3]])
    out = Sampler().apply_logits_processors(LOGITS.expand(3, -1).clone(), meta)
    assert torch.isinf(out[:, 7]).all()
    assert torch.isfinite(out[0, 0]) and torch.isinf(out[1, 0]) and torch.isfinite(out[2, 0])
    greedy = Sampler()(LOGITS.expand(3, -1).clone(), meta).sampled_token_ids.tolist()
    assert greedy == [0, 1, 0]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    eos = 7
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[0])
    meta = meta_for([p, p], outputs=[[1, 1], [1, 1, 1]], eos=[eos, eos])
    out = Sampler()(LOGITS.expand(2, -1).clone(), meta).sampled_token_ids.tolist()
    assert out == [1, 7]  # row 0: EOS(7) and stop 0 masked -> next best is 1
    # EOS registered through update_from_generation_config is masked too.
    q = SamplingParams(temperature=0, min_tokens=1)
    q.update_from_generation_config({}, model_eos_token_id=eos)
    assert Sampler()(LOGITS.clone(), meta_for([q])).sampled_token_ids.item() == 0


def test_min_tokens_yields_when_the_constraint_allows_only_a_stop_token():
    """min_tokens and a constraint that now allows only a stop token (a finished grammar, or
    allowed_token_ids): the constraint wins and the row stops (was: every logit -inf, an
    arbitrary token outside the constraint); a row that still has other allowed tokens keeps
    min_tokens, and so does an unconstrained row in the same batch."""
    eos = 7
    only_stop = SamplingParams(temperature=0, min_tokens=5, allowed_token_ids=[eos])
    stop_or_2 = SamplingParams(temperature=0, min_tokens=5, allowed_token_ids=[eos, 2])
    free = SamplingParams(temperature=0, min_tokens=5)
    meta = meta_for([only_stop, stop_or_2, free], outputs=[[1], [1], [1]], eos=[eos, eos, eos])
    out = Sampler()(LOGITS.expand(3, -1).clone(), meta).sampled_token_ids.tolist()
    assert out == [eos, 2, 0]  # (the free row: EOS masked, the next best is 0)
    # sampled (not greedy) rows too, many draws
    hot = SamplingParams(temperature=1.0, min_tokens=5, allowed_token_ids=[eos])
    meta = meta_for([hot] * 64, outputs=[[1]] * 64, eos=[eos] * 64)
    assert set(Sampler()(LOGITS.expand(64, -1).clone(), meta).sampled_token_ids.tolist()) == {eos}


# ------------------------------------------------------------------ seeds
def test_seeded_rows_reproduce_alone_and_in_a_batch():
    torch.manual_seed(1)
    logits = torch.randn(1, 50)
    seeded = SamplingParams(seed=42, temperature=0.9, top_p=0.95)
    other_seed = SamplingParams(seed=7, top_k=5)
    unseeded = SamplingParams(temperature=1.5)
    greedy = SamplingParams(temperature=0)

    def run(batch_params, seed_row, steps=12):
        gens = [gen(p.seed) if p.seed is not None else None for p in batch_params]
        toks = []
        for _ in range(steps):
            big = torch.cat([logits] * len(batch_params)) + torch.randn(
                len(batch_params), 50) * torch.tensor(
                    [0.0 if i == seed_row else 1.0 for i in range(len(batch_params))]
                ).unsqueeze(1)
            meta = SamplingMetadata.from_requests(
                batch_params, [[0]] * len(batch_params),
                [[] for _ in batch_params], gens, 50)
            toks.append(Sampler()(big, meta).sampled_token_ids[seed_row].item())
        return toks

    alone = run([seeded], 0)
    batch1 = run([unseeded, seeded, other_seed, greedy], 1)
    batch2 = run([other_seed, greedy, unseeded, unseeded, seeded], 4)
    assert alone == batch1 == batch2
    assert len(set(alone)) > 1  # really random, not degenerate
    # A different seed gives a different sequence.
    assert run([SamplingParams(seed=43, temperature=0.9, top_p=0.95)], 0) != alone


# ------------------------------------------------------------------ logprobs
def test_logprobs_and_ranks_vs_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(4, V) * 2
    params = [SamplingParams(logprobs=3, temperature=0.0),
              SamplingParams(logprobs=0, presence_penalty=2.0),
              SamplingParams(logprobs=1, temperature=0.7),
              SamplingParams(temperature=0, logit_bias={int(logits[3].argmin()): 100})]
    meta = meta_for(params, outputs=[[], [int(logits[1].argmax())], [], []])
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (4, 4) and out.logprobs.shape == (4, 4)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    # RAW logprobs: before penalties / bias / temperature.
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    ranks = [(raw[i] >= raw[i, sampled[i]]).sum().item() for i in range(4)]
    assert out.sampled_ranks.tolist() == ranks
    assert out.sampled_ranks[0].item() == 1  # greedy picks rank 1
    assert out.sampled_ranks[3].item() == V  # bias forced the least likely token


def test_compute_prompt_logprobs():
    torch.manual_seed(4)
    logits = torch.randn(5, V)
    target = torch.tensor([3, 0, 7, 7, 1])
    ids, lps, ranks = compute_prompt_logprobs(logits, target, 2)
    raw = torch.log_softmax(logits, -1)
    assert ids.shape == (5, 3) and lps.shape == (5, 3) and ranks.shape == (5,)
    assert torch.equal(ids[:, 0], target)
    assert torch.allclose(lps[:, 0], raw[torch.arange(5), target])
    assert torch.equal(ids[:, 1:], raw.topk(2, -1).indices)
    expected_ranks = (raw >= raw[torch.arange(5), target][:, None]).sum(-1)
    assert torch.equal(ranks, expected_ranks)
    ids0, lps0, _ = compute_prompt_logprobs(logits, target, 0)
    assert ids0.shape == (5, 1)


# ------------------------------------------------------------------ metadata fast paths
def test_metadata_skips_unneeded_tensors():
    m = meta_for([SamplingParams(), SamplingParams(temperature=0)])
    assert m.no_penalties and m.prompt_token_ids is None and m.presence_penalties is None
    assert m.top_k is None and m.top_p is None and m.min_p is None
    assert m.allowed_token_ids_mask is None and m.logit_bias is None
    assert m.min_tokens_mask is None and m.max_num_logprobs is None
    assert not m.all_greedy and not m.all_random and m.greedy_mask.tolist() == [False, True]
    m2 = meta_for([SamplingParams(presence_penalty=0.5)])
    assert not m2.no_penalties and m2.prompt_token_ids is None  # prompt only for repetition
    m3 = meta_for([SamplingParams(repetition_penalty=1.2)], prompts=[[1, 2, 3]])
    assert m3.prompt_token_ids.tolist() == [[1, 2, 3]]
    # Seeded greedy rows keep no generator.
    m4 = meta_for([SamplingParams(temperature=0, seed=1)], gens=[gen(1)])
    assert m4.generators == {} and m4.all_greedy


def test_vocab_width_mismatch_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(1, V + 2), meta_for([SamplingParams()]))


def test_fast_top_p_equals_full_sort_rule():
    """The candidate-based top-p path keeps exactly the tokens the full-sort rule keeps."""
    from pagedllm.sample.sampler import _top_k_top_p_sort, _top_p_fast

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n, v = 6, 5000
        logits = torch.randn(n, v, generator=g) * (4.0 + trial)  # peaked rows
        p = torch.tensor([0.5, 0.9, 0.95, 0.99, 0.3, 1.0])
        k = torch.tensor([v, 40, v, 7, 300, 20]) if trial % 2 else None
        a, b = logits.clone(), logits.clone()
        if not _top_p_fast(a, k, p):
            continue
        _top_k_top_p_sort(b, k, p)
        assert torch.equal(torch.isinf(a), torch.isinf(b)), trial
        assert torch.equal(a[~torch.isinf(a)], b[~torch.isinf(b)])


def test_inverse_cdf_sampling_frequencies_and_zero_probability():
    from pagedllm.sample.sampler import random_sample

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]]).repeat(20000, 1)
    out = random_sample(probs.clone(), {})
    counts = torch.bincount(out, minlength=5).float() / out.numel()
    assert counts[0] == 0 and counts[2] == 0
    torch.testing.assert_close(counts, torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3]), atol=0.015, rtol=0)
