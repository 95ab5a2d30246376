"""The block pool's KV cache events (--kv-events-config): stored runs with their parent hash and
tokens, removals on eviction and on page release, cleared on reset; nothing when not enabled."""
from core_helpers import make_req
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


def admit(mgr, req):
    blocks, hit = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    assert mgr.allocate_slots(req, req.num_tokens - hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return hit


def test_stored_removed_cleared():
    mgr = KVCacheManager(6, 4, hash_seed=0)  # 5 usable blocks of 4 tokens
    pool = mgr.block_pool
    pool.enable_kv_events(4)
    a = Request("a", list(range(100, 110)), make_req("x", 1).sampling_params)  # 2 full blocks + 2
    admit(mgr, a)
    (ev,) = pool.take_kv_events()
    assert ev == ("stored", a.block_hashes[:2], None, list(range(100, 108)), 4, None, None)
    assert pool.take_kv_events() == []  # handed over once
    # b shares a's first block and differs after it: one stored block chained on a's first.
    b = Request("b", list(range(100, 104)) + list(range(200, 205)), a.sampling_params)
    assert admit(mgr, b) == 4
    (ev,) = pool.take_kv_events()
    assert ev == ("stored", [b.block_hashes[1]], a.block_hashes[0], list(range(200, 204)), 4, None, None)
    assert b.block_hashes[0] == a.block_hashes[0]
    # Free both; a 20-token request needs all 5 blocks: every cached block is evicted.
    mgr.free(a)
    mgr.free(b)
    c = make_req("c", 20)
    admit(mgr, c)
    events = pool.take_kv_events()
    removed = [h for e in events if e[0] == "removed" for h in e[1]]
    assert sorted(removed) == sorted([a.block_hashes[0], a.block_hashes[1], b.block_hashes[1]])
    stored = [e for e in events if e[0] == "stored"]
    assert len(stored) == 1 and stored[0][1] == c.block_hashes[:5] and len(stored[0][3]) == 20
    mgr.free(c)
    assert mgr.reset_prefix_cache()
    assert pool.take_kv_events() == [("cleared",)]
    assert not pool.cached_block_hash_to_block


def test_duplicate_hash_is_not_announced_twice():
    """Two requests computing the same prefix at once: the second block stays unhashed (the map
    keeps the first), so only one "stored" event names that hash and one "removed" ends it."""
    mgr = KVCacheManager(10, 4, hash_seed=0)
    pool = mgr.block_pool
    pool.enable_kv_events(4)
    p = list(range(300, 309))
    a, b = (Request(r, p, make_req("x", 1).sampling_params) for r in "ab")
    for r in (a, b):
        mgr.get_computed_blocks(r)  # neither sees the other's blocks yet
        assert mgr.allocate_slots(r, r.num_tokens) is not None
    events = pool.take_kv_events()
    assert [e[0] for e in events] == ["stored"]
    assert events[0][1] == a.block_hashes[:2]


def test_release_gives_removed_and_off_records_nothing():
    mgr = KVCacheManager(6, 4, hash_seed=0)
    pool = mgr.block_pool
    pool.enable_kv_events(4)
    a = make_req("a", 8)
    admit(mgr, a)
    pool.take_kv_events()
    mgr.free(a)
    ids = pool.release_candidates(max_cached_kept=0)
    pool.mark_uncommitted(ids)
    (ev,) = pool.take_kv_events()
    assert ev[0] == "removed" and sorted(ev[1]) == sorted(a.block_hashes[:2])
    off = KVCacheManager(6, 4, hash_seed=0)
    admit(off, make_req("b", 8))
    assert off.block_pool.kv_events is None and off.block_pool.take_kv_events() == []
