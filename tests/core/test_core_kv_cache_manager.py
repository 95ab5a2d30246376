import pytest

from core_helpers import PP, make_req
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


def admit(mgr, req):
    """What the scheduler does on admission: lookup, allocate everything, advance."""
    blocks, hit = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    assert mgr.allocate_slots(req, req.num_tokens - hit, blocks) is not None
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = hit
    req.num_computed_tokens = req.num_tokens
    mgr.check_invariants()
    return hit


def test_allocate_counts_and_free_reverse():
    mgr = KVCacheManager(10, 4, hash_seed=0)
    r = make_req("a", 10)
    assert admit(mgr, r) == 0
    assert mgr.get_block_ids("a") == [1, 2, 3]
    assert mgr.num_free_blocks == 6
    # Decode: 11th token fits in block 3; 13th needs block 4.
    r.append_output_token_ids(5)
    assert mgr.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(5)
    r.num_computed_tokens += 1
    assert mgr.allocate_slots(r, 0) == []
    r.append_output_token_ids(5)
    new = mgr.allocate_slots(r, 1)
    assert [b.block_id for b in new] == [4]
    mgr.free(r)
    assert mgr.get_block_ids("a") == []
    free_ids = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # Next taken first: block 4 (committed, no cached prefix: its pages are resident), then the
    # never-used 5..9, then the cached 3, 2, 1 (tail first). Before committed-first allocation
    # (issue 30) 4 came after 5..9, so steady traffic touched every block of the pool.
    assert free_ids == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    mgr.check_invariants()
    mgr.free(r)  # idempotent


def test_allocate_all_or_nothing():
    mgr = KVCacheManager(5, 4, hash_seed=0)  # 4 usable blocks
    a = make_req("a", 12)
    admit(mgr, a)
    b = make_req("b", 8)
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.get_block_ids("b") == [] and mgr.num_free_blocks == 1
    assert mgr.allocate_slots(b, 4) is not None
    mgr.check_invariants()


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_prefix_hit_counts_not_aligned(algo):
    mgr = KVCacheManager(32, 4, hash_algo=algo)
    prompt = list(range(10))
    a = Request("a", prompt)
    admit(mgr, a)
    b = Request("b", prompt[:9] + [99, 98])  # shares 9 tokens -> 2 full blocks
    assert admit(mgr, b) == 8
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert mgr.get_block_ids("b")[2] != mgr.get_block_ids("a")[2]
    assert mgr.block_pool.blocks[mgr.get_block_ids("a")[0]].ref_cnt == 2
    assert mgr.prefix_cache_stats.queries == 10 + 11
    assert mgr.prefix_cache_stats.hits == 8


def test_prefix_hit_block_aligned_drops_last_block():
    mgr = KVCacheManager(32, 4, hash_seed=0)
    prompt = list(range(12))
    a = Request("a", prompt)
    admit(mgr, a)
    b = Request("b", prompt)  # identical, block-aligned: last block recomputed
    assert admit(mgr, b) == 8
    c = Request("c", prompt + [50])  # 13 tokens: all 3 full blocks hit, token 13 computed
    assert admit(mgr, c) == 12
    d = Request("d", prompt[:11])  # 11 tokens: 2 full blocks hit (< 11)
    assert admit(mgr, d) == 8
    e = Request("e", prompt[:8])  # 8 tokens, aligned: only 1 block
    assert admit(mgr, e) == 4
    mgr.check_invariants()


def test_identical_prompt_after_free_hits_free_blocks():
    mgr = KVCacheManager(6, 4, hash_seed=0)  # 5 usable
    prompt = list(range(9))
    a = Request("a", prompt)
    admit(mgr, a)
    mgr.free(a)
    assert mgr.num_free_blocks == 5
    b = Request("b", prompt)
    assert admit(mgr, b) == 8
    assert mgr.num_free_blocks == 2
    assert mgr.get_block_ids("b")[:2] == [1, 2]


def test_hits_are_not_evicted_by_own_allocation():
    # 3 usable blocks, all free; 2 of them are cached hits. The request needs 3 blocks:
    # the new block must come from the non-hit free block.
    mgr = KVCacheManager(4, 4, hash_seed=0)
    prompt = list(range(8))
    a = Request("a", prompt + [77])
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", prompt + [1, 2, 3])
    assert admit(mgr, b) == 8
    assert sorted(mgr.get_block_ids("b")) == [1, 2, 3]
    c = Request("c", prompt + [1])
    assert mgr.get_computed_blocks(c)[1] == 8
    # Not enough room for c alongside b: hits are held, none free.
    assert mgr.allocate_slots(c, 1, mgr.get_computed_blocks(c)[0]) is None
    mgr.check_invariants()


def test_salt_isolation():
    mgr = KVCacheManager(32, 4, hash_seed=0)
    prompt = list(range(9))
    admit(mgr, Request("a", prompt, cache_salt="alice"))
    assert admit(mgr, Request("b", prompt, cache_salt="bob")) == 0
    assert admit(mgr, Request("c", prompt)) == 0
    assert admit(mgr, Request("d", prompt, cache_salt="alice")) == 8


def test_caching_disabled_and_pooling_skip_cache():
    mgr = KVCacheManager(32, 4, enable_caching=False, hash_seed=0)
    admit(mgr, Request("a", list(range(9))))
    assert admit(mgr, Request("b", list(range(9)))) == 0
    assert mgr.prefix_cache_stats.queries == 0
    mgr2 = KVCacheManager(32, 4, hash_seed=0)
    p = Request("p", list(range(9)), pooling_params=PP())
    admit(mgr2, p)
    assert p.block_hashes == [] and not mgr2.block_pool.cached_block_hash_to_block
    admit(mgr2, Request("g", list(range(9))))
    assert admit(mgr2, Request("p2", list(range(9)), pooling_params=PP())) == 0


def test_prompt_logprobs_skip_lookup_but_fill_cache():
    mgr = KVCacheManager(32, 4, hash_seed=0)
    admit(mgr, make_req("a", list(range(9))))
    assert admit(mgr, make_req("b", list(range(9)), prompt_logprobs=1)) == 0


def test_blocks_cached_when_scheduled_not_when_computed():
    # Chunked prefill: after allocating a 6-token chunk, block 0 is findable at once.
    mgr = KVCacheManager(32, 4, hash_seed=0)
    a = Request("a", list(range(12)))
    mgr.allocate_slots(a, 6)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    b = Request("b", list(range(12)))
    assert mgr.get_computed_blocks(b)[1] == 4
    a.num_computed_tokens = 6
    mgr.allocate_slots(a, 6)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3


def test_max_model_len_must_fit():
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(5, 4, max_model_len=17)
    KVCacheManager(5, 4, max_model_len=16)


def test_reset_prefix_cache():
    mgr = KVCacheManager(8, 4, hash_seed=0)
    a = Request("a", list(range(9)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert admit(mgr, Request("b", list(range(9)))) == 0
    assert mgr.prefix_cache_stats.queries == 18  # totals survive a reset
    assert mgr.usage > 0


@pytest.mark.parametrize("caching", [True, False])
def test_decode_registers_a_block_as_soon_as_it_fills(caching):
    """Decode steps that need no new block still register the block they complete (the
    no-allocation fast path of allocate_slots must not skip it)."""
    mgr = KVCacheManager(32, 4, enable_caching=caching, hash_seed=0)
    r = make_req("a", 6)
    admit(mgr, r)
    cached = mgr.block_pool.cached_block_hash_to_block
    assert len(cached) == (1 if caching else 0)
    for step in range(10):
        r.append_output_token_ids(100 + step)
        held = list(mgr.get_block_ids("a"))
        new = mgr.allocate_slots(r, 1)
        assert new is not None
        total = r.num_computed_tokens + 1
        assert len(mgr.get_block_ids("a")) == -(-total // 4)
        assert (new == []) == (mgr.get_block_ids("a") == held)
        assert len(cached) == (total // 4 if caching else 0)
        if caching:
            assert mgr.num_cached_block["a"] == total // 4
        r.num_computed_tokens = total
        mgr.check_invariants()
