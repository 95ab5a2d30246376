"""Rejection sampler: greedy equals the plain sampler, random output has the target's
distribution (chi-square over >= 20k draws; a deliberately wrong sampler fails the same test),
logits processors see the drafts before each row, seeds, logprobs."""
import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import RejectionSampler, build_verification_metadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams

torch.set_num_threads(1)


def vmeta(params, drafts, outputs=None, prompts=None, vocab=8, eos=None):
    n = len(params)
    return build_verification_metadata(
        params, prompts or [[0]] * n, outputs or [[] for _ in range(n)], drafts, vocab, eos)


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularized upper incomplete gamma
    (chi2 survival function = gammaincc(df / 2, stat / 2)). Cells with expected < 5 are pooled."""
    n = counts.sum().double()
    exp = probs.double() * n
    big = exp >= 5
    obs_c = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().view(1)])
    if exp_c[-1] < 5:  # fold the small pool into the smallest big cell
        i = int(exp_c[:-1].argmin())
        obs_c[i] += obs_c[-1]
        exp_c[i] += exp_c[-1]
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    df = len(exp_c) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# ------------------------------------------------------------------ greedy
def reference_greedy(logits, params, drafts, outputs):
    """Plain Sampler row by row: accept while the argmax equals the draft."""
    out = []
    r = 0
    for i, d in enumerate(drafts):
        toks = []
        for j in range(len(d) + 1):
            m = SamplingMetadata.from_requests([params[i]], [[0]], [outputs[i] + list(d[:j])], [None],
                                               logits.shape[1], None)
            t = int(Sampler()(logits[r + j:r + j + 1].clone(), m).sampled_token_ids[0])
            toks.append(t)
            if j == len(d) or t != d[j]:
                break
        out.append(toks)
        r += len(d) + 1
    return out


@pytest.mark.parametrize("extra", [
    {},
    {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.3},
    {"logit_bias": {3: 2.5, 5: -1.0}},
    {"min_tokens": 3, "stop_token_ids": [1]},
])
def test_greedy_equals_plain_sampler_row_by_row(extra):
    torch.manual_seed(0)
    V = 8
    drafts = [[], [1, 2, 3], [4], [0, 0, 0, 0, 0], [2, 2]]
    outputs = [[1], [2, 3], [], [0, 1], [5]]
    T = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(T, V)
    # Make some drafts the argmax so runs of acceptance happen.
    r = 0
    for d in drafts:
        for j, t in enumerate(d[:2]):
            logits[r + j, t] += 5.0
        r += len(d) + 1
    params = [SamplingParams(temperature=0.0, **extra) for _ in drafts]
    meta = vmeta(params, drafts, outputs=outputs, eos=[1] * len(drafts))
    res = RejectionSampler()(logits, meta, drafts)
    ref = reference_greedy(logits, params, drafts, outputs)
    assert res.output_token_ids == ref
    assert res.num_accepted == [len(t) - 1 for t in ref]
    assert max(res.num_accepted) >= 2  # the test exercised accepted runs


def test_no_drafts_is_the_plain_sampler_and_logits_untouched():
    torch.manual_seed(1)
    logits = torch.randn(6, 8)
    keep = logits.clone()
    params = [SamplingParams(temperature=0.0)] * 6
    res = RejectionSampler()(logits, vmeta(params, [[]] * 6), [[]] * 6)
    assert [t[0] for t in res.output_token_ids] == logits.argmax(-1).tolist()
    assert torch.equal(logits, keep)


# ------------------------------------------------------------------ distribution
V_SMALL = 6
K = 3
TARGET = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0],
                       [0.3, 1.5, 0.1, -0.2, 0.9, 0.0],
                       [-1.0, 0.0, 2.2, 0.4, 0.4, 1.0],
                       [0.5, 0.5, 0.5, 0.1, -0.3, 1.2]])
DRAFT = torch.softmax(torch.tensor([[0.0, 1.0, 0.0, 0.5, -0.5, 0.2],
                                    [1.0, 0.0, 0.3, 0.0, 0.0, 0.0],
                                    [0.0, 0.0, 0.0, 1.5, 0.0, 0.0]]), dim=-1)


def run_distribution(sampler, params, n, one_hot):
    """n independent verifications of K drafts drawn from DRAFT against TARGET rows.

    Returns per position j the emitted-token counts among draws that reached position j."""
    torch.manual_seed(1234)
    drafts_t = torch.stack([torch.multinomial(DRAFT[j], n, replacement=True) for j in range(K)], 1)
    drafts = drafts_t.tolist()
    logits = TARGET.repeat(n, 1)
    meta = SamplingMetadata.from_requests([params] * (n * (K + 1)), [[0]] * (n * (K + 1)),
                                          [[] for _ in range(n * (K + 1))], [None] * (n * (K + 1)),
                                          V_SMALL, None)
    dp = None if one_hot else DRAFT.repeat(n, 1)
    res = sampler(logits, meta, drafts, draft_probs=dp)
    counts = torch.zeros(K + 1, V_SMALL, dtype=torch.int64)
    for toks in res.output_token_ids:
        for j, t in enumerate(toks):
            counts[j, t] += 1
    return counts, res


def target_probs(params):
    m = SamplingMetadata.from_requests([params] * (K + 1), [[0]] * (K + 1), [[] for _ in range(K + 1)],
                                       [None] * (K + 1), V_SMALL, None)
    logits = Sampler().apply_logits_processors(TARGET.clone(), m)
    return Sampler().compute_probs(logits, m)


class WrongRecoverySampler(RejectionSampler):
    """The classic bug: a rejected position resamples from p instead of max(0, p - q)."""

    @staticmethod
    def recovered_distribution(p, q):
        return p


PARAMS = [SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=None)]


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("pi", range(len(PARAMS)))
def test_chi_square_matches_target_distribution(one_hot, pi):
    params = PARAMS[pi]
    n = 24_000
    counts, res = run_distribution(RejectionSampler(), params, n, one_hot)
    p = target_probs(params)
    assert int(counts[0].sum()) == n and int(counts[1].sum()) >= 1000
    for j in range(K + 1):
        reached = int(counts[j].sum())
        if reached >= 500:
            pv = chi_square_pvalue(counts[j], p[j])
            assert pv > 1e-3, (j, pv, counts[j].tolist(), (p[j] * reached).tolist())
    assert 0 < sum(res.num_accepted) < n * K  # some accepted, some rejected


@pytest.mark.parametrize("one_hot", [False, True])
def test_chi_square_rejects_a_wrong_sampler(one_hot):
    params = PARAMS[0]
    counts, _ = run_distribution(WrongRecoverySampler(), params, 24_000, one_hot)
    p = target_probs(params)
    assert chi_square_pvalue(counts[0], p[0]) < 1e-6


def test_chi_square_helper_accepts_exact_sampling():
    torch.manual_seed(5)
    p = torch.softmax(torch.randn(V_SMALL), 0)
    counts = torch.bincount(torch.multinomial(p, 20_000, replacement=True), minlength=V_SMALL)
    assert chi_square_pvalue(counts, p) > 1e-3
    assert chi_square_pvalue(counts, torch.softmax(torch.zeros(V_SMALL), 0)) < 1e-6


# ------------------------------------------------------------------ seeds, mixed, logprobs
def test_seeded_request_independent_of_batch_and_mixed_greedy():
    torch.manual_seed(3)
    V = 8
    seeded = SamplingParams(temperature=0.9, seed=7)
    other = SamplingParams(temperature=1.2)
    greedy = SamplingParams(temperature=0.0)
    d_seeded = [3, 1, 4]
    base = torch.randn(len(d_seeded) + 1, V)

    def run(batch):
        drafts = [d for _, d, _ in batch]
        logits = torch.cat([lg for _, _, lg in batch])
        meta = vmeta([p for p, _, _ in batch], drafts, vocab=V)
        gens = {i: gen(7) for i, (p, _, _) in enumerate(batch) if p.seed is not None}
        return RejectionSampler()(logits, meta, drafts, generators=gens).output_token_ids

    alone = run([(seeded, d_seeded, base)])
    mixed = run([(other, [2, 2], torch.randn(3, V)), (greedy, [5], torch.randn(2, V)),
                 (seeded, d_seeded, base), (other, [], torch.randn(1, V))])
    assert mixed[2] == alone[0]
    again = run([(greedy, [], torch.randn(1, V)), (seeded, d_seeded, base)])
    assert again[1] == alone[0]


def test_logprobs_are_raw_at_each_emitted_row():
    torch.manual_seed(4)
    V = 8
    drafts = [[2, 5], [1]]
    logits = torch.randn(5, V)
    logits[0, 2] += 6  # first request accepts its first draft greedily
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, logprobs=0)]
    res = RejectionSampler()(logits, vmeta(params, drafts, vocab=V), drafts)
    raw = torch.log_softmax(logits, -1)
    r = 0
    for i, toks in enumerate(res.output_token_ids):
        for j, t in enumerate(toks):
            assert int(res.logprob_token_ids[r + j, 0]) == t
            assert res.logprobs[r + j, 0].item() == pytest.approx(raw[r + j, t].item(), abs=1e-6)
            top = raw[r + j].topk(2)
            assert res.logprob_token_ids[r + j, 1:3].tolist() == top.indices.tolist()
            assert int(res.sampled_ranks[r + j]) == int((raw[r + j] >= raw[r + j, t]).sum())
        r += len(drafts[i]) + 1
    assert res.output_token_ids[0][0] == 2


def test_shape_errors():
    rs = RejectionSampler()
    params = [SamplingParams(temperature=1.0)]
    with pytest.raises(ValueError, match="target_logits"):
        rs(torch.randn(2, 8), vmeta(params, [[1, 2]]), [[1, 2]])
    with pytest.raises(ValueError, match="draft_probs"):
        rs(torch.randn(3, 8), vmeta(params, [[1, 2]]), [[1, 2]], draft_probs=torch.rand(1, 8))
