import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_remove_middle_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    assert len(q) == 4
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])


def test_null_block_reserved_and_counts():
    pool = BlockPool(8)
    assert pool.num_usable_blocks == 7
    assert pool.get_num_free_blocks() == 7
    got = pool.get_new_blocks(7)
    assert 0 not in ids(got)
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.usage == 0.0
    pool.check_invariants()


def test_lru_eviction_order_and_lazy_eviction():
    pool = BlockPool(6)  # usable 1..5
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    assert ids(a) == [1, 2] and ids(b) == [3, 4]
    pool.cache_full_blocks(a, [b"h1", b"h2"], 0, 2)
    pool.cache_full_blocks(b, [b"h3", b"h4"], 0, 2)
    # Free a first (reversed: tail block evicted first), then b.
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [5, 2, 1, 4, 3]
    # Freed blocks stay findable (lazy eviction).
    assert pool.get_cached_block(b"h1") is a[0]
    # Next allocation takes 5 (never cached), then 2: h2 evicted, h1 survives.
    got = pool.get_new_blocks(2)
    assert ids(got) == [5, 2]
    assert pool.get_cached_block(b"h2") is None
    assert a[1].block_hash is None
    assert pool.get_cached_block(b"h1") is a[0]
    pool.check_invariants()


def test_touch_removes_from_free_list_and_refcounts():
    pool = BlockPool(4)
    blks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blks, [b"x", b"y", b"z"], 0, 3)
    pool.free_blocks(reversed(blks))
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(b"y")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.free_blocks([hit])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([hit])
    assert pool.get_num_free_blocks() == 3
    # y went back to the tail: z (id 3), x (1), y (2)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 1, 2]
    pool.check_invariants()


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"], 0, 1)
    pool.cache_full_blocks([b], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None
    pool.free_blocks([b, a])
    pool.get_new_blocks(1)  # evicts b (plain), a stays cached
    assert pool.get_cached_block(b"same") is a


def test_reset_prefix_cache_only_when_all_free():
    pool = BlockPool(4)
    blks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blks, [b"p", b"q"], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"p") is not None
    pool.free_blocks(blks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"p") is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blks, [b"p", b"q"], 0, 2)
    assert pool.get_cached_block(b"p") is None


# ---- committed-first allocation (issue 30: KV pages committed on use) ----------------------


def test_fresh_pool_is_uncommitted_and_hands_out_in_id_order():
    pool = BlockPool(6)
    assert pool.num_committed_blocks == 0
    assert not any(b.committed for b in pool.blocks)
    got = pool.get_new_blocks(2)
    assert ids(got) == [1, 2] and all(b.committed for b in got)
    assert pool.num_committed_blocks == 2
    pool.check_invariants()


def test_freed_plain_blocks_are_reused_before_never_used_ones():
    pool = BlockPool(10)  # usable 1..9
    a = pool.get_new_blocks(3)  # 1, 2, 3: committed
    pool.free_blocks(reversed(a))  # no hashes: plain, in order 3, 2, 1
    assert pool.num_committed_blocks == 3
    # Before issue 30 the never-used 4, 5, 6 came first (freed blocks went to the tail).
    b = pool.get_new_blocks(3)
    assert ids(b) == [3, 2, 1]
    assert pool.num_committed_blocks == 3
    pool.free_blocks(b)
    # Steady traffic of 3 blocks at a time never commits a 4th block.
    for _ in range(50):
        pool.free_blocks(pool.get_new_blocks(3))
        pool.free_blocks(pool.get_new_blocks(3))
    assert pool.num_committed_blocks == 3
    pool.check_invariants()


def test_cycling_traffic_keeps_committed_at_the_peak():
    pool = BlockPool(101)  # 100 usable
    held = []
    for i in range(200):  # at most 5 requests of 4 blocks live at once
        held.append(pool.get_new_blocks(4))
        if len(held) > 5:
            pool.free_blocks(reversed(held.pop(0)))
    assert pool.num_committed_blocks == 24  # the peak: 6 x 4 live before the oldest was freed
    pool.check_invariants()


def test_cached_blocks_kept_up_to_budget_then_lru_reused_before_new_ones():
    pool = BlockPool(20, max_free_cached_blocks=2)  # 19 usable
    a = pool.get_new_blocks(4)  # 1..4
    pool.cache_full_blocks(a, [b"a1", b"a2", b"a3", b"a4"], 0, 4)
    pool.free_blocks(reversed(a))  # cached LRU order: 4, 3, 2, 1
    # 4 cached free > budget 2: the two least recently freed (4, 3) are reused, then never-used.
    assert ids(pool.free_block_queue.get_all_free_blocks())[:3] == [4, 3, 5]
    got = pool.get_new_blocks(3)
    assert ids(got) == [4, 3, 5]
    assert pool.get_cached_block(b"a4") is None and pool.get_cached_block(b"a3") is None
    assert pool.get_cached_block(b"a1") is a[0] and pool.get_cached_block(b"a2") is a[1]
    assert pool.num_committed_blocks == 5
    pool.check_invariants()


def test_unlimited_cached_budget_draws_never_used_blocks_before_evicting():
    pool = BlockPool(8)  # max_free_cached_blocks None: evict only when nothing else is free
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [b"x", b"y"], 0, 2)
    pool.free_blocks(reversed(a))
    assert ids(pool.get_new_blocks(5)) == [3, 4, 5, 6, 7]
    assert ids(pool.get_new_blocks(1)) == [2]  # LRU cached block (freed first)
    assert pool.get_cached_block(b"x") is a[0]


def test_prefix_hit_on_free_cached_block_and_touch_from_each_list():
    pool = BlockPool(6, max_free_cached_blocks=1)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [b"p", b"q"], 0, 2)  # block 3 stays plain
    pool.free_blocks(reversed(a))
    assert ids(pool.free_plain.get_all_free_blocks()) == [3]
    assert ids(pool.free_cached.get_all_free_blocks()) == [2, 1]
    hit = pool.get_cached_block(b"p")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and ids(pool.free_cached.get_all_free_blocks()) == [2]
    pool.check_invariants()


def test_release_candidates_and_mark_uncommitted():
    pool = BlockPool(12, max_free_cached_blocks=1)
    live = pool.get_new_blocks(2)  # 1, 2 stay in use
    a = pool.get_new_blocks(4)  # 3..6
    pool.cache_full_blocks(a, [b"h3", b"h4", b"h5"], 0, 3)  # 6 plain
    pool.free_blocks(reversed(a))  # cached LRU: 5, 4, 3; plain: 6
    assert pool.num_committed_blocks == 6
    # Every plain block and the cached ones beyond the most recently used 1.
    assert pool.release_candidates() == [6, 5, 4]
    assert pool.release_candidates(max_cached_kept=0) == [6, 5, 4, 3]
    assert pool.release_candidates(max_cached_kept=3) == [6]
    assert pool.mark_uncommitted([6, 5, 4]) == 3
    assert pool.num_committed_blocks == 3 and pool.num_released_blocks_total == 3
    assert pool.get_cached_block(b"h5") is None and pool.get_cached_block(b"h4") is None
    assert pool.get_cached_block(b"h3") is a[0]  # kept: its KV is intact
    assert not pool.blocks[6].committed and pool.blocks[6].block_hash is None
    pool.check_invariants()
    with pytest.raises(ValueError, match="in use"):
        pool.mark_uncommitted([1])
    with pytest.raises(ValueError, match="in use"):
        pool.mark_uncommitted([0])
    assert pool.mark_uncommitted([6]) == 0  # already uncommitted: no-op
    # Next allocations: never-used 7..11, then the given-back 6, 5, 4, then the cached 3.
    assert ids(pool.get_new_blocks(9)) == [7, 8, 9, 10, 11, 6, 5, 4, 3]
    assert pool.num_committed_blocks == 11
    pool.free_blocks(live)
    pool.check_invariants()


def test_reset_prefix_cache_keeps_blocks_committed():
    pool = BlockPool(5)
    blks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blks, [b"p", b"q"], 0, 2)
    pool.free_blocks(blks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_committed_blocks == 2
    assert ids(pool.free_plain.get_all_free_blocks()) == [1, 2]
    assert ids(pool.get_new_blocks(1)) == [1]
    pool.check_invariants()
