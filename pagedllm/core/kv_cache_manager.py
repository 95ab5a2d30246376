"""Per-request block tables on top of the ``BlockPool`` (pure Python, no torch).

The scheduler asks two things: "how much of this prompt is already cached?"
(``get_computed_blocks``) and "give this request room for N more tokens"
(``allocate_slots``, all-or-nothing). Full blocks are hashed and registered in the
prefix cache as soon as their tokens are *scheduled* (vLLM v1 does the same), so a
second request scheduled later in the same step can already hit them.

NOTE for runners: a block registered this way is filled by the same forward pass
that may read it for another request; the attention backend must write a layer's
new K/V into the cache before any request's attention reads that layer's cache.
"""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from pagedllm.core.kv_cache_utils import get_hash_fn, make_root_hash, update_block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for every running request.

    Args:
        num_blocks: total blocks in the KV cache (block 0 reserved: ``num_blocks - 1`` usable).
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        hash_algo: "sha256" (default) or "xxhash".
        hash_seed: seed for the root block hash (None: random per manager).
        max_model_len: if given, checked to fit in the pool (ValueError saying what fits).
        max_free_cached_blocks: free cached-prefix blocks kept ahead of never-used blocks
            (``BlockPool``); None = no limit.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: Optional[int | str | bytes] = None,
        max_model_len: Optional[int] = None,
        max_free_cached_blocks: Optional[int] = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching, max_free_cached_blocks)
        self.hash_fn = get_hash_fn(hash_algo)
        self.hash_algo = hash_algo
        self.root_hash = make_root_hash(self.hash_fn, hash_seed)
        if max_model_len is not None:
            needed = cdiv(max_model_len, block_size)
            usable = self.block_pool.num_usable_blocks
            if needed > usable:
                raise ValueError(
                    f"max_model_len={max_model_len} needs {needed} KV blocks of {block_size} tokens, "
                    f"but only {usable} fit (max_model_len <= {usable * block_size}); "
                    f"give the KV cache more memory or lower max_model_len")
        # request_id -> its block table (in token order).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> the same table as block ids (kept in step: copying it is cheap).
        self.req_to_block_ids: dict[str, list[int]] = {}
        # request_id -> how many leading blocks of its table are registered in the cache.
        self.num_cached_block: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction (0..1) of usable KV blocks in use."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_pool.prefix_cache_stats

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        """A fresh list of the request's block ids (empty if it holds none)."""
        ids = self.req_to_block_ids.get(request_id)
        return [] if ids is None else ids.copy()

    def skip_caching(self, request: Any) -> bool:
        """Requests that neither hit nor fill the prefix cache (pooling, caching off)."""
        return not self.enable_caching or request.pooling_params is not None

    def skip_lookup(self, request: Any) -> bool:
        # NOTE: prompt logprobs need every prompt position's logits, so no prefix hit.
        sp = request.sampling_params
        return self.skip_caching(request) or getattr(sp, "prompt_logprobs", None) is not None

    def get_computed_blocks(self, request: Any) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        The hit is capped below ``request.num_tokens`` (at least the last token is
        recomputed so a logit comes out): a block-aligned, fully cached prompt loses its
        last block. Pure lookup: takes no references and records no stats.

        Returns:
            (blocks, num_computed_tokens) with ``num_computed_tokens == len(blocks) * block_size``.
        """
        if self.skip_lookup(request):
            return [], 0
        update_block_hashes(request, self.block_size, self.hash_fn, self.root_hash)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # ---- mutations -----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` tokens after ``request.num_computed_tokens``
        (plus the prefix-hit ``new_computed_blocks``, only on admission).

        All or nothing: returns None (and changes nothing) when not enough blocks are
        free. On success returns the newly allocated blocks; the request's whole table
        is ``req_to_blocks[request_id]``. Full blocks covering the tokens computed this
        step are registered in the prefix cache.

        Prefix-cache stats are recorded here (not in the lookup) on a request's first
        admission (``request.num_cached_tokens < 0``), so a failed admission that is
        retried next step is counted once.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is not None and not new_computed_blocks:
            # Fast path (most decode steps): the held blocks already have room and no block
            # becomes full, so there is nothing to allocate or register.
            total = request.num_computed_tokens + num_new_tokens
            bs = self.block_size
            if total <= len(req_blocks) * bs:
                if not self.enable_caching or request.pooling_params is not None:  # skip_caching
                    return []
                if min(total, request.num_tokens) // bs <= self.num_cached_block[req_id]:
                    return []
        new_computed_blocks = new_computed_blocks or []
        is_admission = req_blocks is None
        if new_computed_blocks and not is_admission:
            raise ValueError(f"request {req_id} already holds blocks; prefix hits only on admission")
        num_held = 0 if req_blocks is None else len(req_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(total, self.block_size) - num_held - len(new_computed_blocks))
        # Hit blocks that are free sit in the free list: touching them shrinks it.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.req_to_block_ids[req_id] = []
            self.num_cached_block[req_id] = 0
        if new_computed_blocks:
            # NOTE: touch before get_new_blocks, or the hits could be evicted right here.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.req_to_block_ids[req_id].extend(b.block_id for b in new_computed_blocks)
            self.num_cached_block[req_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if new_blocks:
            req_blocks.extend(new_blocks)
            self.req_to_block_ids[req_id].extend(b.block_id for b in new_blocks)

        if self.skip_caching(request):
            return new_blocks
        if is_admission and request.num_cached_tokens < 0 and not self.skip_lookup(request):
            self.prefix_cache_stats.record(request.num_tokens, len(new_computed_blocks) * self.block_size)
        num_full = min(total, request.num_tokens) // self.block_size
        num_cached = self.num_cached_block[req_id]
        if num_full > num_cached:
            update_block_hashes(request, self.block_size, self.hash_fn, self.root_hash)
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full,
                                              request)
            self.num_cached_block[req_id] = num_full
        return new_blocks

    def free(self, request: Any) -> None:
        """Release the request's blocks, last block first (so its tail is evicted first).

        Cached blocks stay findable until reused. No-op for a request holding no blocks.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Assert pool consistency and that ref counts equal the number of tables holding each block."""
        self.block_pool.check_invariants()
        counts: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        assert self.req_to_block_ids.keys() == self.req_to_blocks.keys()
        for req_id, blocks in self.req_to_blocks.items():
            assert self.req_to_block_ids[req_id] == [b.block_id for b in blocks], req_id
        for b in self.block_pool.blocks[1:]:
            assert b.ref_cnt == counts.get(b.block_id, 0), (b, counts.get(b.block_id, 0))
