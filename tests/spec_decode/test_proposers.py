"""N-gram and suffix proposers against straightforward references."""
import random

import numpy as np
import pytest

from pagedllm.spec_decode.ngram import NgramProposer, find_ngram_continuation
from pagedllm.spec_decode.suffix import SuffixProposer, SuffixTrie


def ngram_reference(tokens, min_n, max_n, k):
    """Plain loops: longest n; the latest occurrence with k tokens after it, else the earliest."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pat = tokens[L - n:]
        ends = [e for e in range(n - 1, L - 1) if tokens[e - n + 1:e + 1] == pat]
        if ends:
            full = [e for e in ends if e + k <= L - 1]
            e = full[-1] if full else ends[0]
            return tokens[e + 1:e + 1 + k]
    return []


def test_ngram_matches_reference_on_random_sequences():
    rng = random.Random(0)
    for trial in range(300):
        L = rng.randint(1, 60)
        toks = [rng.randint(0, 4) for _ in range(L)]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        got = find_ngram_continuation(np.array(toks, dtype=np.int64), lo, hi, k).tolist()
        assert got == ngram_reference(toks, lo, hi, k), (toks, lo, hi, k)


def test_ngram_copies_the_prompt_and_keeps_a_growing_buffer():
    p = NgramProposer(4, 2, 3)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    # The output started copying the prompt: "12 13" -> propose "14 15 16 17".
    assert p.propose("a", prompt + [12], [13]) == [14, 15, 16, 17]
    assert p.propose("a", prompt + [12, 13], [14, 15]) == [16, 17, 12, 13]  # runs on into the copy
    assert p.propose("a", prompt + [12, 13, 14, 15], [16], max_tokens=1) == [17]
    assert p.propose("a", [1, 2, 3], [4]) == []  # shorter history: buffer rebuilt, no match
    p.remove("a")
    assert p.num_requests == 0


def test_suffix_trie_counts_and_removal():
    t = SuffixTrie(3)
    t.extend([1, 2, 1, 2])
    t.end_stream()
    assert t.find([1, 2]).count == 2 and t.find([2, 1]).count == 1 and t.find([1, 2, 1]).count == 1
    n_before = t.num_nodes
    t.extend([5, 6])
    t.end_stream()
    t.remove_sequence([5, 6])
    assert t.num_nodes == n_before and t.find([5]) is None
    t.remove_sequence([1, 2, 1, 2])
    assert t.num_nodes == 0 and not t.root.children


def test_suffix_proposes_the_frequent_continuation():
    p = SuffixProposer(4, max_tree_depth=8, min_token_prob=0.1)
    prompt = [7, 1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2]
    assert p.propose("r", prompt, [], len(prompt)) == [3, 4]  # "1 2" -> 3 4 then 8|9 split
    # "1 2 3" (3 tokens: at most 3 drafts) -> 4, then 9 or 8 (1/2 each), then 1.
    assert p.propose("r", prompt, [3], len(prompt)) == [4, 9, 1]
    strict = SuffixProposer(4, max_tree_depth=8, min_token_prob=0.6)
    assert strict.propose("r", prompt, [3], len(prompt)) == [4]
    p.remove("r", finished=False)
    assert p.num_cached_requests == 0


def test_suffix_global_cache_bound_and_eviction():
    p = SuffixProposer(3, max_tree_depth=6, max_cached_requests=2)
    outs = {f"r{i}": [100 + i, 50, 51, 52, 53] for i in range(4)}
    for rid, out in outs.items():
        p.propose(rid, [1] + out, [], 1)
        p.remove(rid)
    assert p.num_cached_requests == 2  # filled past the bound: the oldest two evicted
    fresh = SuffixTrie(6)
    for rid in ("r2", "r3"):
        fresh.extend(outs[rid])
        fresh.end_stream()
    assert p.global_trie.num_nodes == fresh.num_nodes
    assert p.global_trie.find([100]) is None and p.global_trie.find([103]) is not None
    # A new request whose output starts like the cached ones gets the cached continuation.
    assert p.propose("new", [1, 2, 50], [51], 1) == [52, 53]
