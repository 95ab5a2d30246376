"""KV cache tensors whose pages are committed on first write and can be given back (issue 30).

On CPU each layer's cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` lives in its own
private anonymous mapping (mmap(2) ``MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE``, page-aligned,
wrapped without a copy by ``torch.frombuffer``). Such pages read as zero and become resident only
when first written, so a fresh cache costs address space, not memory: the block budget
(``kv_cache_memory``) stays the bound, and resident KV follows the blocks the block pool has handed
out (``pagedllm.core.block_pool``: committed blocks are reused before never-used ones).

``release_kv_ranges`` gives the pages of free blocks back: madvise(2) ``MADV_DONTNEED`` on a private
anonymous range frees its pages at once, and the next read of that range sees zeros (a fresh
page), exactly as before it was first written. Only whole pages are dropped: where a block is
smaller than a page, or does not end on a page boundary, a page is dropped only when every block
on it is being released (consecutive block ids form one range).

Transparent huge pages are turned off for these mappings (``MADV_NOHUGEPAGE``): a 2 MiB page
would be committed by the first 16 KiB block written to it and could not be given back block by
block. ``PAGEDLLM_KV_LAZY=0`` allocates with ``torch.zeros`` instead (every page touched at
start-up); CUDA caches are always ``torch.zeros``.
"""
from __future__ import annotations

import mmap
import os
import sys
from typing import Iterable, Sequence

import torch
from pagedllm import envs

PAGE_SIZE = mmap.PAGESIZE
# NOTE: Python < 3.12 has no mmap.MAP_NORESERVE; 0x4000 is its value on Linux (mman-linux.h).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def lazy_kv_enabled(device: torch.device) -> bool:
    """Whether KV caches on ``device`` are committed on use: CPU with ``mmap.madvise`` (Linux),
    unless ``PAGEDLLM_KV_LAZY=0``."""
    return (device.type == "cpu" and hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")
            and bool(envs.get("PAGEDLLM_KV_LAZY")))


def new_kv_cache(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor of ``shape`` (``[num_blocks, ...]``, contiguous) and ``dtype``.

    On CPU (``lazy_kv_enabled``) it is backed by a fresh anonymous mapping of
    ``ceil(nbytes / PAGE_SIZE)`` pages, none of them resident until written; the mapping is kept
    alive by the tensor (``tensor._kv_mmap``, also what ``release_kv_ranges`` uses). Elsewhere it is
    ``torch.zeros``.
    """
    if not lazy_kv_enabled(device):
        return torch.zeros(*shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(*shape, dtype=dtype, device=device)
    map_bytes = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
    mm = mmap.mmap(-1, map_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # NOTE: kernels without THP reject it; nothing to turn off then
            pass
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).view(*shape)
    t._kv_mmap = mm  # keeps the mapping alive with the tensor (frombuffer holds it too)
    return t


def block_runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct block ids as sorted half-open ranges of consecutive ids:
    [7, 1, 2, 3] -> [(1, 4), (7, 8)]."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(int(i) for i in ids)):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def release_kv_ranges(caches: Iterable[torch.Tensor], runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Give the pages of the blocks in ``runs`` (half-open ``[b0, b1)`` ranges of block ids, sorted,
    not overlapping; blocks whose contents are not needed) of every lazily allocated cache in
    ``caches`` back to the OS (madvise(2) ``MADV_DONTNEED``).

    Per cache (block ``b`` spans bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of its mapping)
    and per range, the pages wholly inside ``[b0 * block_bytes, b1 * block_bytes)`` are dropped (up
    to the mapping's end for the last block). Caches not allocated by ``new_kv_cache`` (CUDA,
    ``PAGEDLLM_KV_LAZY=0``) are skipped.

    Returns:
        ranges of the blocks of which at least one page was dropped in some cache (sorted, merged):
        their contents now read (partly) as zeros, so the block pool must forget any prefix they
        cached (``BlockPool.mark_uncommitted``). A block that shares each of its pages with a
        block outside ``runs`` is not in them and keeps its contents.
    """
    touched: list[tuple[int, int]] = []
    for t in caches:
        mm = getattr(t, "_kv_mmap", None)
        if mm is None:
            continue
        num_blocks = t.shape[0]
        block_bytes = t.numel() * t.element_size() // num_blocks
        nbytes = num_blocks * block_bytes
        for b0, b1 in runs:
            if not 0 <= b0 < b1 <= num_blocks:
                raise ValueError(f"release_kv_ranges: bad range [{b0}, {b1}) of {num_blocks} blocks")
            start = -(-(b0 * block_bytes) // PAGE_SIZE) * PAGE_SIZE
            end_byte = b1 * block_bytes
            end = len(mm) if end_byte == nbytes else end_byte // PAGE_SIZE * PAGE_SIZE
            if end <= start:
                continue
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            # NOTE: start >= b0 * block_bytes and end <= b1 * block_bytes (or the mapping's tail
            # past the last block), so these blocks all lie inside [b0, b1).
            touched.append((start // block_bytes, min(b1, -(-end // block_bytes))))
    return merge_runs(touched)


def merge_runs(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open ranges merged into sorted, disjoint ones: [(5, 8), (1, 3), (2, 4)] -> [(1, 4), (5, 8)]."""
    out: list[tuple[int, int]] = []
    for b0, b1 in sorted(ranges):
        if out and b0 <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b1))
        else:
            out.append((b0, b1))
    return out


def release_kv_pages(caches: Iterable[torch.Tensor], block_ids: Iterable[int]) -> set[int]:
    """``release_kv_ranges`` for a set of block ids; returns the ids that lost a page."""
    touched = release_kv_ranges(list(caches), block_runs(block_ids))
    return {b for b0, b1 in touched for b in range(b0, b1)}


def _mincore_resident(addr: int, length: int) -> int:
    """Pages of ``[addr, addr + length)`` (page-aligned) mapped in this process: mincore(2)'s
    vector, low bit of each byte. Raises OSError where the call fails."""
    import ctypes

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    npages = -(-length // PAGE_SIZE)
    vec = (ctypes.c_ubyte * npages)()
    rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())


def kv_resident_bytes(caches: Iterable[torch.Tensor]) -> int:
    """Resident bytes of the lazily allocated caches among ``caches``, per page (mincore(2) on each
    mapping; 0 for the others). NOTE: a page that was only ever read maps the kernel's shared zero
    page, which mincore counts but RSS does not; attention reads only slots it wrote, so the two
    agree for a cache the engine filled. Costs one byte per page: for tests and diagnostics."""
    total = 0
    for t in caches:
        mm = getattr(t, "_kv_mmap", None)
        if mm is not None:
            total += _mincore_resident(t.data_ptr(), len(mm)) * PAGE_SIZE
    return total
