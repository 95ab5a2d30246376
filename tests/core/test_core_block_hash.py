import pytest

from pagedllm.core.kv_cache_utils import (get_hash_fn, hash_block_tokens, make_root_hash,
                                          update_block_hashes)
from pagedllm.core.request import Request


@pytest.mark.parametrize("algo,size", [("sha256", 32), ("xxhash", 16)])
def test_hash_algos(algo, size):
    fn = get_hash_fn(algo)
    root = make_root_hash(fn, 123)
    h = hash_block_tokens(fn, root, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == size
    assert h == hash_block_tokens(fn, root, (1, 2, 3, 4))
    assert h != hash_block_tokens(fn, root, [1, 2, 3, 5])
    assert h != hash_block_tokens(fn, root, [1, 2, 3, 4], ("salt",))
    assert h != hash_block_tokens(fn, make_root_hash(fn, 124), [1, 2, 3, 4])


def test_unknown_algo():
    with pytest.raises(ValueError):
        get_hash_fn("md5")


def test_random_root_by_default():
    fn = get_hash_fn("sha256")
    assert make_root_hash(fn) != make_root_hash(fn)
    assert make_root_hash(fn, "s") == make_root_hash(fn, "s")


def test_chained_and_incremental():
    fn = get_hash_fn("sha256")
    root = make_root_hash(fn, 0)
    r = Request("a", list(range(10)))
    assert update_block_hashes(r, 4, fn, root) == 2
    assert update_block_hashes(r, 4, fn, root) == 0
    first = list(r.block_hashes)
    r.append_output_token_ids([10, 11])
    assert update_block_hashes(r, 4, fn, root) == 1
    assert r.block_hashes[:2] == first
    h0 = hash_block_tokens(fn, root, [0, 1, 2, 3])
    assert r.block_hashes[0] == h0
    assert r.block_hashes[1] == hash_block_tokens(fn, h0, [4, 5, 6, 7])
    assert r.block_hashes[2] == hash_block_tokens(fn, r.block_hashes[1], [8, 9, 10, 11])
    # Same second block, different first block -> different second hash (chaining).
    r2 = Request("b", [9, 1, 2, 3, 4, 5, 6, 7])
    update_block_hashes(r2, 4, fn, root)
    assert r2.block_hashes[1] != r.block_hashes[1]


def test_salt_only_on_first_block_but_propagates():
    fn = get_hash_fn("sha256")
    root = make_root_hash(fn, 0)
    a = Request("a", list(range(8)), cache_salt="s1")
    b = Request("b", list(range(8)), cache_salt="s2")
    c = Request("c", list(range(8)))
    for r in (a, b, c):
        update_block_hashes(r, 4, fn, root)
    assert a.block_hashes[0] == hash_block_tokens(fn, root, [0, 1, 2, 3], ("s1",))
    assert a.block_hashes[1] == hash_block_tokens(fn, a.block_hashes[0], [4, 5, 6, 7], None)
    assert len({a.block_hashes[1], b.block_hashes[1], c.block_hashes[1]}) == 3
