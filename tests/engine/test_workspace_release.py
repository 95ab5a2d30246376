"""A long prompt's freed workspace does not stay resident once the batch is decode-only (issue 30.4):
``pagedllm.metrics.memory.WorkspaceTrimmer`` trims the caching CPU allocator's free blocks to
``WORKSPACE_KEEP_BYTES`` (and glibc's heap) on the first decode-sized step after a prefill-sized one,
then restores the cap. Also ``smaps_breakdown`` (where resident memory goes) against what it
can measure exactly: a lazily committed KV cache's pages."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm.kernels.cpu_ops import cpu_allocator_stats, get_ops, install_cpu_allocator
from pagedllm.metrics.memory import WORKSPACE_KEEP_BYTES, WorkspaceTrimmer, smaps_breakdown

MiB = 1 << 20

ops = get_ops()
needs_allocator = pytest.mark.skipif(ops is None or not hasattr(ops, "install_cpu_allocator"),
                                     reason="C++ CPU kernels could not be built here")


def _fill_cache(total: int) -> None:
    """Allocate and free blocks of distinct sizes (a prefill's temporaries) worth ``total`` bytes."""
    blocks = [torch.ones((4 + i) * MiB // 4, dtype=torch.float32) for i in range(64) if (4 + i) * MiB <= total]
    n = 0
    keep = []
    for b in blocks:
        if n + b.numel() * 4 > total:
            break
        n += b.numel() * 4
        keep.append(b)
    del blocks, keep
    gc.collect()


@needs_allocator
def test_decode_step_after_prefill_trims_the_allocator_cache_to_the_bound():
    assert install_cpu_allocator()
    ops.cpu_allocator_empty_cache()
    cap = cpu_allocator_stats()["max_cached_bytes"]
    _fill_cache(160 * MiB)
    before = cpu_allocator_stats()["cached_bytes"]
    assert before > 2 * WORKSPACE_KEEP_BYTES  # the "prefill" left its blocks in the cache
    t = WorkspaceTrimmer()
    assert not t.step(num_tokens=2048, num_requests=3)  # prefill chunk: nothing trimmed yet
    assert cpu_allocator_stats()["cached_bytes"] == before
    assert t.step(num_tokens=8, num_requests=8)  # first decode-only step: trimmed
    st = cpu_allocator_stats()
    assert 0 < st["cached_bytes"] <= WORKSPACE_KEEP_BYTES, st
    assert st["max_cached_bytes"] == cap  # the cap is back: decode keeps reusing its blocks
    assert not t.step(num_tokens=8, num_requests=8)  # once per prefill, not every decode step
    # Decode-sized steps that freed blocks since: kept (only a new prefill re-arms the trim).
    _fill_cache(64 * MiB)
    assert cpu_allocator_stats()["cached_bytes"] > WORKSPACE_KEEP_BYTES
    assert not t.step(num_tokens=16, num_requests=8)
    assert t.trims == 1
    ops.cpu_allocator_empty_cache()


def test_spec_decode_sized_steps_do_not_arm_the_trim():
    t = WorkspaceTrimmer(big_step_tokens=256)
    assert not t.step(num_tokens=16 * 5, num_requests=16)  # 16 requests x (1 + 4 draft tokens)
    assert not t.dirty and t.trims == 0


def test_smaps_breakdown_counts_committed_kv_pages():
    from pagedllm.worker.kv_memory import new_kv_cache

    shape = (512, 2, 16, 4, 64)  # 32 KiB blocks
    block = 2 * 16 * 4 * 64 * 4
    base = smaps_breakdown()
    cache = new_kv_cache(shape, torch.float32, torch.device("cpu"))
    if not hasattr(cache, "_kv_mmap"):
        pytest.skip("KV caches are not lazily committed here (PAGEDLLM_KV_LAZY=0 or no madvise)")
    assert smaps_breakdown()["kv"] - base["kv"] == 0  # reserved, nothing committed
    cache[:200].fill_(1.0)
    b = smaps_breakdown()
    assert b["kv"] - base["kv"] == 200 * block
    assert abs(b["total"] - sum(v for k, v in b.items() if k != "total")) == 0
    del cache
