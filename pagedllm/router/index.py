"""The router's prefix index: block hash -> replicas holding that block, built from the replicas'
KV cache events (``pagedllm.kv_events``, vLLM's wire format). Pure Python, no torch.

Why the router hashes again: a replica's block hashes chain on a per-process random root
(``pagedllm.core.kv_cache_utils``), so they cannot be recomputed outside it. Every
``BlockStored`` event carries the blocks' token ids and its parent's hash, so the index keeps,
per replica, the replica's hash -> the router's own hash of the same block, where the router's
hash chains the same way (``H(parent, block tokens)``, parent of the first block a fixed root).
A request's prompt tokens, cut into ``block_size`` blocks and hashed with ``chain_hashes``,
then name the same keys, and ``match`` returns how many leading blocks each replica holds.

Bound: at most ``max_blocks`` router hashes (the LRU one, by last store or match, is dropped
first, for every replica that held it) and at most ``max_blocks`` replica-hash entries per
replica (oldest first). Dropped entries are counted (``stats()``); a drop only makes routing
miss a prefix, never send a request wrong. Blocks of LoRA requests (``lora_id`` set) are not
indexed (their hashes include the adapter, which the router does not know).
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Sequence

#: Parent of every chain's first block in the router's hashes.
ROOT = b"pagedllm-router-root"


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The router's hash of one full block: 16-byte BLAKE2b of the parent hash and the tokens
    (int32 array)."""
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Router hashes of every full ``block_size``-token block of ``token_ids`` (a partial last
    block has none, as in the prefix cache)."""
    out: list[bytes] = []
    parent = ROOT
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def leading_matches(holders: Callable[[Any], Optional[set[int]]], hashes: Iterable[Any]) -> dict[int, int]:
    """Replica -> how many leading blocks of ``hashes`` it holds, where ``holders(h)`` gives the
    replicas holding block ``h`` (None or empty: none); replicas holding none are absent."""
    out: dict[int, int] = {}
    alive: Optional[set[int]] = None
    for depth, h in enumerate(hashes, 1):
        got = holders(h)
        if not got:
            break
        alive = set(got) if alive is None else alive & got
        if not alive:
            break
        for r in alive:
            out[r] = depth
    return out


class PrefixIndex:
    """Which replicas hold which blocks (thread-safe: events arrive on a subscriber thread).

    Args:
        max_blocks: the bound on router hashes, and on each replica's hash map (>= 1).

    Raises:
        ValueError: ``max_blocks`` < 1.
    """

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._blocks: "OrderedDict[bytes, set[int]]" = OrderedDict()
        self._ext: dict[int, "OrderedDict[Any, bytes]"] = {}
        self.block_size: dict[int, int] = {}
        self.evicted = 0          # router hashes dropped at the bound
        self.ext_evicted = 0      # replica-hash entries dropped at the bound
        self.unchained = 0        # stored runs whose parent the index does not know (skipped)
        self.stored = 0
        self.removed = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _add(self, replica: int, ext: Any, rh: bytes) -> None:
        m = self._ext.setdefault(replica, OrderedDict())
        m[ext] = rh
        m.move_to_end(ext)
        if len(m) > self.max_blocks:
            old_ext, old_rh = m.popitem(last=False)
            self.ext_evicted += 1
            self._discard(replica, old_rh)
        holders = self._blocks.get(rh)
        if holders is None:
            holders = self._blocks[rh] = set()
        holders.add(replica)
        self._blocks.move_to_end(rh)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.evicted += 1

    def _discard(self, replica: int, rh: bytes) -> None:
        holders = self._blocks.get(rh)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._blocks[rh]

    def block_stored(self, replica: int, block_hashes: Sequence[Any], parent_block_hash: Any,
                     token_ids: Sequence[int], block_size: int, lora_id: Optional[int] = None) -> int:
        """Apply one ``BlockStored`` event of ``replica``; returns the blocks indexed."""
        if lora_id is not None or block_size < 1:
            return 0
        with self._lock:
            self.block_size[replica] = block_size
            m = self._ext.setdefault(replica, OrderedDict())
            if parent_block_hash is None:
                parent = ROOT
            else:
                got = m.get(parent_block_hash)
                if got is None:
                    self.unchained += 1
                    return 0
                parent = got
            n = 0
            for i, ext in enumerate(block_hashes):
                toks = token_ids[i * block_size:(i + 1) * block_size]
                if len(toks) < block_size:
                    break
                parent = block_hash(parent, toks)
                self._add(replica, ext, parent)
                n += 1
            self.stored += n
            return n

    def block_removed(self, replica: int, block_hashes: Iterable[Any]) -> None:
        """Apply one ``BlockRemoved`` event of ``replica``."""
        with self._lock:
            m = self._ext.get(replica)
            if m is None:
                return
            for ext in block_hashes:
                rh = m.pop(ext, None)
                if rh is not None:
                    self.removed += 1
                    self._discard(replica, rh)

    def clear_replica(self, replica: int) -> None:
        """Forget every block of ``replica`` (``AllBlocksCleared``, a gap in its events, or the
        replica died)."""
        with self._lock:
            m = self._ext.pop(replica, None)
            for rh in (m or {}).values():
                self._discard(replica, rh)

    def match(self, hashes: Sequence[bytes]) -> dict[int, int]:
        """Replica -> the number of leading blocks of ``hashes`` (``chain_hashes``) it holds
        (replicas holding none are absent). Matched blocks become most recently used."""
        blocks = self._blocks

        def holders(h: bytes) -> Optional[set[int]]:
            got = blocks.get(h)
            if got:
                blocks.move_to_end(h)
            return got

        with self._lock:
            return leading_matches(holders, hashes)

    def replica_blocks(self, replica: int) -> int:
        """Blocks of ``replica`` in the index."""
        return len(self._ext.get(replica, ()))

    def stats(self) -> dict[str, int]:
        """Counters for /metrics."""
        return {"blocks": len(self._blocks), "capacity": self.max_blocks, "evicted": self.evicted,
                "ext_evicted": self.ext_evicted, "unchained": self.unchained, "stored": self.stored,
                "removed": self.removed}
