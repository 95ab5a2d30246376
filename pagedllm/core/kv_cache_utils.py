"""Chained block hashes for the prefix cache (pure Python, no torch).

A full block's hash is ``H(parent_hash, tuple(token_ids), extra_keys)``: it names the
block's tokens *and* everything before them, so equal hashes mean equal prefixes.
The first block's parent is a root hash derived from ``hash_seed`` or, by default,
from ``os.urandom`` (so two servers never share hash values by accident).
``extra_keys`` carries the request's ``cache_salt`` and LoRA adapter id on the first block only
(the chain carries them to every later block).

Hashes are ``bytes``: 32 bytes for ``"sha256"``, 16 bytes for ``"xxhash"`` (xxh3_128).
"""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, Optional, Sequence

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

HASH_ALGOS = ("sha256", "xxhash")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(algo: str) -> HashFn:
    """Return ``bytes -> bytes`` for ``algo`` ("sha256" or "xxhash").

    Raises:
        ValueError: unknown algorithm.
        ImportError: "xxhash" requested but the ``xxhash`` package is missing.
    """
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        import xxhash  # NOTE: optional dependency; only imported when selected.

        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown prefix-cache hash algorithm {algo!r}; expected one of {HASH_ALGOS}")


def make_root_hash(hash_fn: HashFn, seed: Optional[int | str | bytes] = None) -> BlockHash:
    """Parent hash of every request's first block.

    ``seed=None`` draws 32 random bytes (``os.urandom``): hashes are then only
    comparable inside this process. Pass a seed to make them reproducible.
    """
    if seed is None:
        return hash_fn(os.urandom(32))
    if isinstance(seed, int):
        seed = str(seed)
    if isinstance(seed, str):
        seed = seed.encode("utf-8")
    return hash_fn(b"pagedllm-root:" + seed)


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: Optional[tuple[Any, ...]] = None,
) -> BlockHash:
    """Hash one full block chained on its parent.

    NOTE: pickle of a tuple of bytes/ints/str is a stable serialization within one
    Python version, which is all a per-process cache needs.
    """
    data = pickle.dumps((parent_block_hash, tuple(token_ids), extra_keys), protocol=5)
    return hash_fn(data)


def block_extra_keys(request: Any, block_index: int, block_size: Optional[int] = None) -> Optional[tuple[Any, ...]]:
    """Extra keys mixed into block ``block_index`` of ``request``: on block 0, its
    ``cache_salt`` (a str) and its LoRA adapter's ``lora_int_id`` (an int), so requests with
    different adapters (or none) never share KV blocks; and for a prompt given as embeddings
    the digest of those embeddings (its token ids are placeholders), so it never shares blocks
    with a token prompt or other embeddings.

    With ``block_size``, a block that holds image placeholder tokens (``request.mm_features``)
    also mixes in the content hash of every image whose placeholder run overlaps it (vLLM v1's
    ``mm_hashes`` extra keys): the same image in the same place hits, another image misses."""
    mm = _mm_extra_keys(request, block_index, block_size) if block_size else None
    if block_index != 0:
        return mm
    base = _first_block_keys(request)
    if mm is None:
        return base
    return (base or ()) + mm


def _mm_extra_keys(request: Any, block_index: int, block_size: int) -> Optional[tuple[Any, ...]]:
    feats = getattr(request, "mm_features", None)
    if not feats:
        return None
    a, b = block_index * block_size, (block_index + 1) * block_size
    hashes = tuple(f.identifier for f in feats if f.offset < b and f.offset + f.length > a)
    return ("mm",) + hashes if hashes else None


def _first_block_keys(request: Any) -> Optional[tuple[Any, ...]]:
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    embeds = getattr(request, "prompt_embeds_hash", None)
    if embeds is not None:  # a prompt given as embeddings: its token ids are placeholders
        return (salt, lora.lora_int_id if lora is not None else None, "prompt_embeds", embeds)
    if lora is not None:
        return (salt, lora.lora_int_id) if salt else (lora.lora_int_id,)
    return (salt,) if salt else None


def update_block_hashes(
    request: Any, block_size: int, hash_fn: HashFn, root_hash: BlockHash
) -> int:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``.

    Each block's hash is computed once (the list only grows; tokens of a full block
    never change). Returns the number of hashes added.
    """
    hashes = request.block_hashes
    token_ids = request.all_token_ids
    num_full = len(token_ids) // block_size
    start = len(hashes)
    for i in range(start, num_full):
        parent = hashes[i - 1] if i > 0 else root_hash
        toks = token_ids[i * block_size:(i + 1) * block_size]
        hashes.append(hash_block_tokens(hash_fn, parent, toks, block_extra_keys(request, i, block_size)))
    return max(0, num_full - start)
