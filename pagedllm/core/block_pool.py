"""KV-cache blocks, their free lists and the prefix-cache hash map (pure Python).

Block 0 is reserved as the *null block*: it is never handed out, never freed and
never cached, so runners may pad block tables with id 0 (writes there are
harmless). Usable blocks are therefore ``num_blocks - 1``.

Committed blocks: on CPU the KV cache's pages become resident only when first written
(``pagedllm.worker.kv_memory``), so a block is *committed* from the moment it is first handed
out (its pages are about to be written) until the worker gives its pages back to the OS
(``mark_uncommitted``, after an idle period). The pool hands out committed blocks before
never-used (or given-back) ones, so the resident KV cache follows the peak of live blocks plus
the cached prefixes kept, not the whole pool.

Free lists: doubly-linked lists threaded through the blocks themselves (vLLM v1), one per kind
of free block; a block is in exactly one of them while its ``ref_cnt`` is 0:

* plain: committed, no cached prefix (a request's partial tail, a duplicate, caching off);
* cached: committed and findable by hash, least recently freed at the head (LRU eviction);
* uncommitted: never written since start-up or since its pages were given back.

KV cache events (``--kv-events-config``): with ``enable_kv_cache_events`` the pool records, in
``kv_events``, each hash registered (``("stored", [hash, ...], parent_hash | None, token_ids,
block_size, lora_id, lora_name)``, one entry per contiguous run of newly registered blocks of
one request), each hash dropped from the map (``("removed", [hash, ...])``: an evicted cached
block, or one whose pages were given back) and each successful reset (``("cleared",)``).
``take_kv_events()`` hands them over (the engine core publishes them after every step), so the
list holds at most one step's events.

``get_new_blocks`` takes, for each block: a plain one; else the LRU cached one if more than
``max_free_cached_blocks`` cached blocks are free; else an uncommitted one; else the LRU cached
one. A freed block keeps its hash and stays findable in the hash map until it is taken again
(lazy eviction); a prefix-cache hit on a free block unlinks it from the middle of its list in
O(1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from pagedllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache.

    Attributes:
        block_id: index into the KV cache tensors' block dimension.
        ref_cnt: number of request block tables holding this block.
        block_hash: chained hash of the block's tokens once full and cached, else None.
        prev_free_block / next_free_block: free-list links (None when not in the list).
        is_null: True for the reserved null block (id 0).
        committed: handed out at least once since start-up or since its pages were last given
            back (its KV pages may be resident).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null",
                 "committed")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None
        self.is_null = False
        self.committed = False

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
        if block is None or block is self._tail:
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
        assert last is not None, "the free list's tail sentinel lost its link"
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks head (next evicted) to tail."""
        out: list[KVCacheBlock] = []
        b = self._head.next_free_block
        while b is not None and b is not self._tail:
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


class _FreeBlocksView:
    """``BlockPool.free_block_queue``: every free block, in the order ``get_new_blocks`` takes
    them (``get_all_free_blocks``), and their count (``num_free_blocks``, ``len``)."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def __len__(self) -> int:
        return self.num_free_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        p = self._pool
        cached = p.free_cached.get_all_free_blocks()
        over = p._num_cached_over_budget()
        return (p.free_plain.get_all_free_blocks() + cached[:over]
                + p.free_uncommitted.get_all_free_blocks() + cached[over:])


class BlockPool:
    """Owns every ``KVCacheBlock``: allocation, ref counts, the free lists, the hash map.

    Args:
        num_blocks: total blocks in the KV cache tensors, including the null block 0.
        enable_caching: keep full blocks findable by hash (prefix caching).
        max_free_cached_blocks: free blocks holding a cached prefix that are kept ahead of
            never-used ones: past this many, the least recently used cached block is reused before
            an uncommitted block is drawn (so resident KV is at most the peak of live blocks plus
            this many). None = no limit (cached blocks are evicted only when nothing else is free).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 max_free_cached_blocks: Optional[int] = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if max_free_cached_blocks is not None and max_free_cached_blocks < 0:
            raise ValueError(f"max_free_cached_blocks must be >= 0, got {max_free_cached_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_free_cached_blocks = max_free_cached_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_plain = FreeKVCacheBlockQueue([])
        self.free_cached = FreeKVCacheBlockQueue([])
        self.free_uncommitted = FreeKVCacheBlockQueue(self.blocks[1:])
        self.free_block_queue = _FreeBlocksView(self)
        #: usable blocks with ``committed`` set (the null block is not counted).
        self.num_committed_blocks = 0
        #: blocks given back to the OS so far (``mark_uncommitted``), a running total.
        self.num_released_blocks_total = 0
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        #: KV cache events since the last ``take_kv_events`` (None = not recorded).
        self.kv_events: Optional[list[tuple[Any, ...]]] = None
        self.kv_event_block_size = 0

    def enable_kv_events(self, block_size: int) -> None:
        """Start recording KV cache events (see the module docstring); ``block_size``: tokens per
        block (the token ids of a "stored" event)."""
        self.kv_event_block_size = block_size
        if self.kv_events is None:
            self.kv_events = []

    def take_kv_events(self) -> list[tuple[Any, ...]]:
        """The events recorded since the last call (oldest first); [] when not recording."""
        ev = self.kv_events
        if not ev:
            return []
        self.kv_events = []
        return ev

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return (self.free_plain.num_free_blocks + self.free_cached.num_free_blocks
                + self.free_uncommitted.num_free_blocks)

    def get_usage(self) -> float:
        """Fraction (0..1) of usable blocks held by at least one request."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    usage = property(get_usage)

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The block cached under ``block_hash`` (possibly free, i.e. ref 0), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def _num_cached_over_budget(self) -> int:
        if self.max_free_cached_blocks is None:
            return 0
        return max(0, self.free_cached.num_free_blocks - self.max_free_cached_blocks)

    def _queue_of(self, block: KVCacheBlock) -> FreeKVCacheBlockQueue:
        """The free list a free ``block`` belongs in (by its hash and committed flag)."""
        if block.block_hash is not None:
            return self.free_cached
        return self.free_plain if block.committed else self.free_uncommitted

    def _take_one(self) -> KVCacheBlock:
        if self.free_plain.num_free_blocks:
            return self.free_plain.popleft()
        if self._num_cached_over_budget() > 0 or not self.free_uncommitted.num_free_blocks:
            return self.free_cached.popleft()
        block = self.free_uncommitted.popleft()
        block.committed = True
        self.num_committed_blocks += 1
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, committed ones first (see the module docstring),
        evicting the hashes of cached blocks taken.

        Returns blocks with ``ref_cnt == 1``. Raises ValueError if not enough are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks ({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(num_blocks):
            block = self._take_one()
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
            if self.kv_events is not None:
                ev = self.kv_events
                if ev and ev[-1][0] == "removed":
                    ev[-1][1].append(h)  # one event per run of evictions
                else:
                    ev.append(("removed", [h]))
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hit); unlink blocks that were free."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self._queue_of(block).remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the tail of their free
        list (cached or plain) in the given order (so the first given is evicted first)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self._queue_of(block).append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        request: Any = None,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (held by a request) under
        their hashes.

        If another block already holds the same hash (two requests computed the same
        prefix concurrently), the existing one stays in the map and the new block stays
        unhashed (it is freed as a plain block).

        ``request`` (its ``all_token_ids``, ``lora_request``) feeds the "stored" KV events
        when they are recorded (``enable_kv_events``).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(block_hashes) >= num_full_blocks, (len(block_hashes), num_full_blocks)
        stored: Optional[list[int]] = [] if self.kv_events is not None and request is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            assert block.ref_cnt > 0, block  # NOTE: a free block's list depends on its hash
            h = block_hashes[i]
            if h in self.cached_block_hash_to_block:
                continue
            block.block_hash = h
            self.cached_block_hash_to_block[h] = block
            if stored is not None:
                stored.append(i)
        if stored:
            self._record_stored(stored, block_hashes, request)

    def _record_stored(self, indices: list[int], block_hashes: list[BlockHash], request: Any) -> None:
        """One "stored" event per contiguous run of newly registered block indices."""
        tokens = request.all_token_ids
        lora = getattr(request, "lora_request", None)
        lora_id = lora.lora_int_id if lora is not None else None
        lora_name = lora.lora_name if lora is not None else None
        bs = self.kv_event_block_size
        events = self.kv_events
        assert events is not None
        run = [indices[0]]
        for i in indices[1:] + [None]:
            if i is not None and i == run[-1] + 1:
                run.append(i)
                continue
            first, last = run[0], run[-1]
            events.append((
                "stored", [block_hashes[j] for j in run], block_hashes[first - 1] if first > 0 else None,
                list(tokens[first * bs:(last + 1) * bs]), bs, lora_id, lora_name))
            if i is not None:
                run = [i]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use; returns success."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.free_cached.get_all_free_blocks():
            self.free_cached.remove(block)
            block.block_hash = None
            self.free_plain.append(block)
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.append(("cleared",))
        # NOTE: stats stay monotonic totals (metrics take deltas of them).
        return True

    # ---- giving pages back ---------------------------------------------------------

    def release_candidates(self, max_cached_kept: Optional[int] = None) -> list[int]:
        """Ids of the free committed blocks whose pages may go back to the OS: every plain free
        block, and the least recently used cached ones beyond the ``max_cached_kept`` most
        recently used (None = ``max_free_cached_blocks``; None there too = keep every cached
        block). Changes nothing: the worker drops pages, then ``mark_uncommitted`` records it."""
        keep = self.max_free_cached_blocks if max_cached_kept is None else max_cached_kept
        cached = self.free_cached.get_all_free_blocks()
        n_cached = 0 if keep is None else max(0, len(cached) - keep)
        return [b.block_id for b in self.free_plain.get_all_free_blocks()] + [b.block_id for b in cached[:n_cached]]

    def mark_uncommitted(self, block_ids: Iterable[int]) -> int:
        """Record that the worker dropped (some of) the pages of these free blocks (their contents
        now read as zeros): each loses its cached hash and moves to the uncommitted list.

        Raises:
            ValueError: a block that is in use or the null block (its contents are live).
        Returns:
            blocks that were committed and now are not.
        """
        n = 0
        for bid in block_ids:
            block = self.blocks[bid]
            if block.is_null or block.ref_cnt > 0:
                raise ValueError(f"mark_uncommitted: {block} is in use")
            if not block.committed:
                continue
            self._queue_of(block).remove(block)
            self._maybe_evict_cached_block(block)
            block.committed = False
            self.free_uncommitted.append(block)
            n += 1
        self.num_committed_blocks -= n
        self.num_released_blocks_total += n
        return n

    def check_invariants(self) -> None:
        """Assert free-list/ref-count/hash-map/committed consistency (debug and tests)."""
        plain = self.free_plain.get_all_free_blocks()
        cached = self.free_cached.get_all_free_blocks()
        unc = self.free_uncommitted.get_all_free_blocks()
        free = plain + cached + unc
        assert len(free) == self.get_num_free_blocks()
        assert len({b.block_id for b in free}) == len(free), "block in two free lists"
        assert all(b.ref_cnt == 0 for b in free), "free block with references"
        assert all(b.committed and b.block_hash is None for b in plain), "plain list: committed, no hash"
        assert all(b.committed and b.block_hash is not None for b in cached), "cached list: committed, hashed"
        assert all(not b.committed and b.block_hash is None for b in unc), "uncommitted list: no hash"
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert len(free) + used == self.num_usable_blocks, (len(free), used, self.num_usable_blocks)
        assert all(b.committed for b in self.blocks[1:] if b.ref_cnt > 0), "block in use but not committed"
        assert self.num_committed_blocks == sum(b.committed for b in self.blocks[1:])
        for h, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == h, (b, h)
