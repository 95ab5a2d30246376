"""Grammar bitmasks in the sampler: the unpacking matches a bit-by-bit reference, disallowed
tokens never come out, the allowed ones keep their exact relative probabilities, and the
other stages (penalties, temperature, top-k/p) then work on the allowed tokens only."""
import math

import pytest
import torch

from pagedllm.sample.bitmask import apply_token_bitmask, apply_token_bitmask_torch, unpack_bitmask
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams

torch.set_num_threads(1)


def pack(allowed: list[list[bool]]) -> torch.Tensor:
    """Reference packing: bit j of word w = token 32w + j (as int32, two's complement)."""
    v = len(allowed[0])
    w = (v + 31) // 32
    out = torch.zeros(len(allowed), w, dtype=torch.int32)
    for i, row in enumerate(allowed):
        for wi in range(w):
            word = 0
            for j in range(32):
                t = 32 * wi + j
                if t < v and row[t]:
                    word |= 1 << j
            out[i, wi] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def meta_for(params, vocab):
    n = len(params)
    return SamplingMetadata.from_requests(params, [[0]] * n, [[] for _ in range(n)], [None] * n, vocab)


@pytest.mark.parametrize("vocab", [32, 70, 129])
def test_unpack_matches_bit_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    allowed = (torch.rand(5, vocab, generator=g) < 0.3)
    allowed[0, :] = True  # all words -1 (bit 31 set: negative int32)
    allowed[1, :] = False
    allowed[2, 31::32] = True  # exactly the sign bits
    bm = pack(allowed.tolist())
    assert torch.equal(unpack_bitmask(bm, vocab), allowed)
    # A narrower bitmask than the vocabulary: the ids past it are not allowed.
    assert not unpack_bitmask(bm[:, :1], vocab)[:, 32:].any()


@pytest.mark.parametrize("apply", [apply_token_bitmask, apply_token_bitmask_torch])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_on_a_subset_of_rows(apply, dtype):
    logits = torch.randn(4, 40).to(dtype)
    ref = logits.clone()
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[0, [3, 7, 39]] = True
    allowed[1, [0]] = True
    apply(logits, torch.tensor([2, 0]), pack(allowed.tolist()))
    assert torch.equal(logits[1], ref[1]) and torch.equal(logits[3], ref[3])
    assert torch.equal(logits[2][allowed[0]], ref[2][allowed[0]])
    assert torch.isinf(logits[2][~allowed[0]]).all()
    assert torch.equal(logits[0][allowed[1]], ref[0][allowed[1]])
    assert torch.isinf(logits[0][~allowed[1]]).all()


@pytest.mark.parametrize("vocab,width", [(49152, 1536), (70, 3), (100, 3)])
def test_fast_path_equals_the_torch_oracle(vocab, width):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    bm = torch.randint(-2**31, 2**31 - 1, (3, width), dtype=torch.int32, generator=g)
    for rows in (torch.tensor([4, 1, 5]), torch.arange(3)):
        a, b = logits[:len(rows) + 3].clone(), logits[:len(rows) + 3].clone()
        if len(rows) == 3 and rows.tolist() == [0, 1, 2]:
            a, b = logits[:3].clone(), logits[:3].clone()
        apply_token_bitmask(a, rows, bm)
        apply_token_bitmask_torch(b, rows, bm)
        assert torch.equal(a, b)


def test_sampler_never_picks_a_masked_token_and_renormalizes_exactly():
    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(1, vocab) * 3
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [1, 5, 9, 33, 49]] = True
    bm = pack(allowed.tolist())
    n = 4000
    params = [SamplingParams(temperature=0.7, seed=None)] * n
    meta = meta_for(params, vocab)
    meta.grammar_bitmask = (torch.arange(n), bm.expand(n, -1).contiguous())
    out = Sampler()(logits.expand(n, -1).clone(), meta)
    ids = out.sampled_token_ids
    assert set(ids.tolist()) <= {1, 5, 9, 33, 49}
    # Frequencies match softmax(logits / T) over the allowed tokens only.
    ref = torch.softmax(logits[0, allowed[0]] / 0.7, dim=-1)
    freq = torch.stack([(ids == t).float().mean() for t in (1, 5, 9, 33, 49)])
    assert torch.allclose(freq, ref, atol=4 * math.sqrt(0.25 / n) + 0.01)


def test_greedy_takes_the_best_allowed_and_logprobs_stay_raw():
    vocab = 64
    logits = torch.linspace(0, 1, vocab).repeat(3, 1)  # token 63 is the best everywhere
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [2, 10]] = True
    allowed[1, 40:50] = True
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 3
    meta = meta_for(params, vocab)
    meta.grammar_bitmask = (torch.tensor([0, 2]), pack(allowed.tolist()))
    out = Sampler()(logits.clone(), meta)
    assert out.sampled_token_ids.tolist() == [10, 63, 49]
    # vLLM's default: logprobs come from the raw model distribution, before any processing.
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs[:, 0], raw[torch.arange(3), out.sampled_token_ids])
    assert out.logprob_token_ids[0, 1].item() == 63


def test_mask_comes_before_penalties_and_top_k():
    vocab = 40
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 5.0   # best overall, but not allowed
    logits[0, 7] = 2.0
    logits[0, 8] = 1.9
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [7, 8]] = True
    # top_k=1 after the mask keeps token 7 (before it, token 0 would be kept and then masked).
    params = [SamplingParams(temperature=1.0, top_k=1, seed=3)]
    meta = meta_for(params, vocab)
    meta.grammar_bitmask = (torch.tensor([0]), pack(allowed.tolist()))
    assert Sampler()(logits.clone(), meta).sampled_token_ids.tolist() == [7]
    # A repetition penalty on token 7 (in the output) makes 8 the greedy choice among the allowed.
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    meta = SamplingMetadata.from_requests([p], [[1]], [[7]], [None], vocab)
    meta.grammar_bitmask = (torch.tensor([0]), pack(allowed.tolist()))
    assert Sampler()(logits.clone(), meta).sampled_token_ids.tolist() == [8]
