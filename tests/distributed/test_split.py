"""Pure split arithmetic of the sharding pass (no processes)."""
from __future__ import annotations

import pytest

from pagedllm.distributed.tensor_parallel import head_split, split_range


def test_split_range_covers_everything_once():
    for n, size, align in [(10, 3, 1), (1536, 2, 64), (9, 2, 1), (255, 4, 1)]:
        parts = [split_range(n, size, r, align) for r in range(size)]
        assert parts[0][0] == 0 and sum(c for _, c in parts) == n
        assert all(parts[i][0] + parts[i][1] == parts[i + 1][0] for i in range(size - 1))
        assert all(c % align == 0 for _, c in parts)
    with pytest.raises(ValueError):
        split_range(3, 4, 0)


def test_head_split_kv_groups_and_replication():
    # SmolLM2: 9 query / 3 KV heads over 2 ranks -> split on KV boundaries (group 3).
    assert [head_split(9, 3, 2, r) for r in range(2)] == [(0, 3, 0, 1), (3, 6, 1, 2)]
    # Gemma 3 270M: 4 query / 1 KV head over 2 ranks -> the KV head replicated.
    assert [head_split(4, 1, 2, r) for r in range(2)] == [(0, 2, 0, 1), (2, 2, 0, 1)]
    # Every query head on exactly one rank, mapped to the KV head it uses at TP=1.
    for hq, hkv, size in [(32, 8, 4), (8, 2, 4), (12, 4, 2), (6, 3, 2)]:
        seen = []
        for r in range(size):
            q0, nq, kv0, nkv = head_split(hq, hkv, size, r)
            for h in range(q0, q0 + nq):
                local_kv = (h - q0) // (nq // nkv)
                assert kv0 + local_kv == h // (hq // hkv)
                seen.append(h)
        assert seen == list(range(hq))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        head_split(6, 3, 4, 0)
