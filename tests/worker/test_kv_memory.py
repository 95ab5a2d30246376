"""KV cache pages committed on first write and given back when idle (issue 30).

Resident figures come from two independent sources: the block pool's committed counter (what the
engine reports as ``kv_cache_committed_bytes``) and the kernel's own accounting (the mappings'
``Rss`` in /proc/self/smaps, and the process's ``RssAnon`` in /proc/self/status; proc(5)).
"""
from __future__ import annotations

import mmap

import pytest
import torch

from pagedllm.worker.kv_memory import PAGE_SIZE, kv_resident_bytes, new_kv_cache, release_kv_pages

from pagedllm.metrics.memory import anon_resident_bytes as rss_anon

MiB = 1 << 20



def test_fresh_cache_is_zero_and_not_resident_until_written():
    before = rss_anon()
    # 64 blocks x 1 MiB (2 x 16 tokens x 8 heads x 512 dims x 8 bytes) = 64 MiB reserved.
    kv = new_kv_cache((64, 2, 16, 8, 512), torch.float64, torch.device("cpu"))
    assert kv.shape == (64, 2, 16, 8, 512) and kv.dtype == torch.float64 and kv.is_contiguous()
    assert isinstance(kv._kv_mmap, mmap.mmap) and kv.data_ptr() % PAGE_SIZE == 0
    assert kv_resident_bytes([kv]) == 0
    assert rss_anon() - before < 4 * MiB  # reserving 64 MiB committed (almost) nothing
    kv[10:30] = 1.5  # write 20 blocks = 20 MiB
    assert kv_resident_bytes([kv]) == 20 * MiB
    grown = rss_anon() - before
    assert 19 * MiB < grown < 24 * MiB, grown
    # NOTE: reductions over the view itself (kv[:10].abs() would allocate a 10 MiB temporary)
    assert float(kv[:10].amax()) == 0.0 and float(kv[:10].amin()) == 0.0
    # Reading never-written pages maps the shared zero page: no memory (RSS) committed.
    assert rss_anon() - before - grown < 2 * MiB


def test_release_drops_pages_and_they_read_zero():
    kv = new_kv_cache((64, 2, 16, 8, 512), torch.float64, torch.device("cpu"))  # 1 MiB blocks
    kv[:32] = 2.0
    assert kv_resident_bytes([kv]) == 32 * MiB
    before = rss_anon()
    touched = release_kv_pages([kv], [3, 4, 5, 20, 31])
    assert touched == {3, 4, 5, 20, 31}
    assert kv_resident_bytes([kv]) == 27 * MiB
    assert before - rss_anon() > 4 * MiB  # the kernel's own count fell by the 5 MiB given back
    assert float(kv[3:6].abs().sum()) == 0.0 and float(kv[20].abs().sum()) == 0.0
    assert bool((kv[6:20] == 2.0).all()) and bool((kv[:3] == 2.0).all())  # neighbours intact
    # (Reading the released blocks mapped the shared zero page: mincore counts it, RSS does not.)
    anon = rss_anon()
    kv[4] = 3.0  # a released block is written again: committed again
    assert bool((kv[4] == 3.0).all())
    assert 0.9 * MiB < rss_anon() - anon < 2 * MiB


def test_blocks_smaller_than_a_page_release_whole_pages_only():
    # 1 KiB blocks (2 x 2 tokens x 1 head x 64 dims x 4 bytes): 4 blocks per 4 KiB page.
    assert PAGE_SIZE == 4096
    kv = new_kv_cache((40, 2, 2, 1, 64), torch.float32, torch.device("cpu"))
    kv[:] = 1.0
    assert kv_resident_bytes([kv]) == 40 * 1024
    # Blocks 1, 2: no whole page is theirs alone -> nothing dropped, contents kept.
    assert release_kv_pages([kv], [1, 2]) == set()
    assert bool((kv[1:3] == 1.0).all())
    # Blocks 3..9 cover bytes [3 KiB, 10 KiB): only page [4 KiB, 8 KiB) = blocks 4..7 goes.
    assert release_kv_pages([kv], [3, 4, 5, 6, 7, 8, 9]) == {4, 5, 6, 7}
    assert kv_resident_bytes([kv]) == 36 * 1024
    assert float(kv[4:8].abs().sum()) == 0.0
    assert bool((kv[3] == 1.0).all()) and bool((kv[8:10] == 1.0).all())
    # The last blocks include the mapping's tail page: 36..39 are page 9 exactly.
    assert release_kv_pages([kv], [36, 37, 38, 39]) == {36, 37, 38, 39}


def test_odd_block_size_keeps_shared_pages():
    # 6 KiB blocks (2 x 3 tokens x 8 heads x 64 dims x 2 bytes, bf16): pages straddle blocks.
    kv = new_kv_cache((10, 2, 3, 8, 64), torch.bfloat16, torch.device("cpu"))
    kv[:] = 1.0
    # Block 1 = bytes [6, 12) KiB: only page [8, 12) KiB is wholly inside it.
    assert release_kv_pages([kv], [1]) == {1}
    assert float(kv[0].float().abs().sum()) == float(kv[0].numel())  # block 0 untouched
    assert bool((kv[2] == 1.0).all())
    k1 = kv[1].reshape(-1)
    assert bool((k1[:1024] == 1.0).all()) and float(k1[1024:].float().abs().sum()) == 0.0


def test_zeros_fallback(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KV_LAZY", "0")
    kv = new_kv_cache((4, 2, 16, 2, 64), torch.float32, torch.device("cpu"))
    assert getattr(kv, "_kv_mmap", None) is None and float(kv.abs().sum()) == 0.0
    kv[:] = 1
    assert release_kv_pages([kv], [1, 2]) == set()  # not lazily allocated: nothing to give back
    assert bool((kv == 1).all())


def test_fp8_cache_views():
    kv = new_kv_cache((8, 2, 16, 2, 64), torch.float8_e4m3fn, torch.device("cpu"))
    assert kv.dtype == torch.float8_e4m3fn and kv.element_size() == 1
    kv[1] = 2.0
    assert kv_resident_bytes([kv]) == PAGE_SIZE and float(kv[1].float().mean()) == 2.0


def test_runs_and_merge():
    from pagedllm.worker.kv_memory import block_runs, merge_runs

    assert block_runs([7, 1, 2, 3, 3]) == [(1, 4), (7, 8)]
    assert block_runs([]) == []
    assert merge_runs([(5, 8), (1, 3), (2, 4), (8, 9)]) == [(1, 4), (5, 9)]


def test_bad_range_is_refused():
    from pagedllm.worker.kv_memory import release_kv_ranges

    kv = new_kv_cache((4, 2, 16, 2, 64), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="bad range"):
        release_kv_ranges([kv], [(2, 9)])
