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
