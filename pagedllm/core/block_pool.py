"""KV-cache blocks, their LRU free list and the prefix-cache hash map (pure Python).

Block 0 is reserved as the *null block*: it is never handed out, never freed and
never cached, so runners may pad block tables with id 0 (writes there are
harmless). Usable blocks are therefore ``num_blocks - 1``.

Free list: a doubly-linked list threaded through the blocks themselves (vLLM v1).
Blocks are taken from the head (least recently freed) and returned to the tail.
A freed block keeps its hash and stays findable in the hash map until it is
taken again (lazy eviction); a prefix-cache hit on a free block unlinks it from
the middle of the list in O(1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from pagedllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache.

    Attributes:
        block_id: index into the KV cache tensors' block dimension.
        ref_cnt: number of request block tables holding this block.
        block_hash: chained hash of the block's tokens once full and cached, else None.
        prev_free_block / next_free_block: free-list links (None when not in the list).
        is_null: True for the reserved null block (id 0).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly-linked LRU queue of free blocks with sentinel head and tail (O(1) ops)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free list")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks head (next evicted) to tail."""
        out = []
        b = self._head.next_free_block
        while b is not self._tail:
            out.append(b)
            b = b.next_free_block
        return out


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens (``requests`` counts lookups)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens


class BlockPool:
    """Owns every ``KVCacheBlock``: allocation, ref counts, the free list, the hash map.

    Args:
        num_blocks: total blocks in the KV cache tensors, including the null block 0.
        enable_caching: keep full blocks findable by hash (prefix caching).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction (0..1) of usable blocks held by at least one request."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    usage = property(get_usage)

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The block cached under ``block_hash`` (possibly free, i.e. ref 0), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the free-list head (LRU), evicting their hashes.

        Returns blocks with ``ref_cnt == 1``. Raises ValueError if not enough are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks ({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            out.append(block)
        return out

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        h = block.block_hash
        if h is None:
            return False
        block.block_hash = None
        if self.cached_block_hash_to_block.get(h) is block:
            del self.cached_block_hash_to_block[h]
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hit); unlink blocks that were free."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free-list
        tail in the given order (so the first given is evicted first)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        If another block already holds the same hash (two requests computed the same
        prefix concurrently), the existing one stays in the map and the new block stays
        unhashed (it is freed as a plain block).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(block_hashes) >= num_full_blocks, (len(block_hashes), num_full_blocks)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            h = block_hashes[i]
            if h in self.cached_block_hash_to_block:
                continue
            block.block_hash = h
            self.cached_block_hash_to_block[h] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use; returns success."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        # NOTE: stats stay monotonic totals (metrics take deltas of them).
        return True

    def check_invariants(self) -> None:
        """Assert free-list/ref-count/hash-map consistency (debug and tests)."""
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.get_num_free_blocks()
        assert all(b.ref_cnt == 0 for b in free), "free block with references"
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert len(free) + used == self.num_usable_blocks, (len(free), used, self.num_usable_blocks)
        for h, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == h, (b, h)
