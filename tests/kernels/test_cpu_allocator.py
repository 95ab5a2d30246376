"""The caching CPU allocator (csrc/cpu_allocator.cpp, ``cpu_ops.install_cpu_allocator``).

Installing it is process-wide (it is what every CPU engine does at start), so these tests
install it once and check what it does with real tensors: large blocks are reused after free
(no fresh page faults), small ones go to torch's allocator, contents stay intact across threads
and fork, the cache respects its cap, and the engine installs it unless told not to.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from pagedllm.kernels.cpu_ops import (DEFAULT_ALLOCATOR_CACHE_BYTES, DEFAULT_ALLOCATOR_MIN_BYTES,
                                      get_ops, install_cpu_allocator)

ops = get_ops()
pytestmark = pytest.mark.skipif(ops is None or not hasattr(ops, "install_cpu_allocator"),
                                reason="C++ CPU kernels could not be built here")

MiB = 1 << 20


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt


@pytest.fixture(autouse=True)
def installed():
    assert install_cpu_allocator()
    gc.collect()  # earlier tests' garbage must not be freed into the cache mid-test
    ops.cpu_allocator_empty_cache()
    yield
    ops.install_cpu_allocator(DEFAULT_ALLOCATOR_MIN_BYTES, DEFAULT_ALLOCATOR_CACHE_BYTES, False)


def test_large_blocks_are_reused_without_page_faults():
    live0 = ops.cpu_allocator_stats()["live_bytes"]  # other tests' engines may hold blocks
    x = torch.empty(64 * MiB, dtype=torch.uint8)
    x.fill_(7)  # faults its pages in once
    ptr = x.data_ptr()
    assert ptr % 4096 == 0  # page-aligned (2 MiB-aligned only with huge pages: below)
    del x
    s0 = ops.cpu_allocator_stats()
    assert s0["cached_bytes"] == 64 * MiB and s0["live_bytes"] == live0
    f0 = _minor_faults()
    y = torch.empty(60 * MiB, dtype=torch.uint8)  # within 25% of the cached block: reused
    y.fill_(1)
    faults = _minor_faults() - f0
    s1 = ops.cpu_allocator_stats()
    assert y.data_ptr() == ptr
    assert s1["hits"] == s0["hits"] + 1 and s1["misses"] == s0["misses"]
    assert s1["cached_bytes"] == 0 and s1["live_bytes"] == live0 + 64 * MiB
    # A fresh 60 MiB mapping would fault ~15,000 4 KiB pages in; the reused one none of them.
    assert faults < 500, faults
    assert int(y.sum()) == 60 * MiB


def test_small_and_much_larger_requests_are_not_served_from_the_cache():
    x = torch.empty(8 * MiB, dtype=torch.uint8)
    del x
    s0 = ops.cpu_allocator_stats()
    small = torch.ones(1000)  # under min_bytes: torch's allocator
    big = torch.empty(32 * MiB, dtype=torch.uint8)  # 4x the cached block: a new one
    s1 = ops.cpu_allocator_stats()
    assert s1["hits"] == s0["hits"] and s1["misses"] == s0["misses"] + 1
    assert s1["live_bytes"] == s0["live_bytes"] + 32 * MiB and s1["cached_bytes"] == 8 * MiB
    assert float(small.sum()) == 1000.0 and big.numel() == 32 * MiB


def test_cache_cap_and_empty_cache():
    ops.install_cpu_allocator(DEFAULT_ALLOCATOR_MIN_BYTES, 16 * MiB)  # only changes the limits
    a = torch.empty(10 * MiB, dtype=torch.uint8)
    b = torch.empty(10 * MiB, dtype=torch.uint8)
    del a, b  # the second does not fit under the 16 MiB cap: returned to the OS
    assert ops.cpu_allocator_stats()["cached_bytes"] == 10 * MiB
    ops.cpu_allocator_empty_cache()
    assert ops.cpu_allocator_stats()["cached_bytes"] == 0


def test_tensors_allocated_and_freed_on_other_threads():
    live0 = ops.cpu_allocator_stats()["live_bytes"]
    results = []

    def work(seed: int) -> None:
        for i in range(20):
            t = torch.full((2 * MiB,), float(seed * 100 + i))  # 8 MiB float32
            results.append(bool((t == seed * 100 + i).all()))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 80
    keep = [torch.full((MiB,), 3.0) for _ in range(3)]
    freed_elsewhere = threading.Thread(target=keep.clear)
    freed_elsewhere.start()
    freed_elsewhere.join()
    assert ops.cpu_allocator_stats()["live_bytes"] == live0


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_small_raw_allocations_go_back_to_the_base_allocator():
    """oneDNN (ideep) allocates its buffers and scratchpads with raw_allocate()/raw_deallocate()
    on torch's CPU allocator. raw_deallocate() calls this allocator's deleter for every pointer, so
    a block under min_bytes (served by torch's allocator) must be handed back to it: it used to be
    dropped, leaking ~0.5 MiB per engine step of a bf16 model (issue 25)."""
    w = torch.randn(256, 256)  # 256 KiB: under min_bytes, so the base allocator serves it
    for _ in range(50):  # warm-up: malloc arenas reach their working size
        m = w.to_mkldnn()
        del m
    rss0 = _resident_bytes()
    live0 = ops.cpu_allocator_stats()["live_bytes"]
    for i in range(1000):  # 250 MiB of blocks if they were not freed
        m = w.to_mkldnn()
        if i % 250 == 0:
            assert torch.equal(m.to_dense(), w)
        del m
    grown = _resident_bytes() - rss0
    assert grown < 32 * MiB, f"resident memory grew by {grown / MiB:.0f} MiB"
    assert ops.cpu_allocator_stats()["live_bytes"] == live0


def test_blocks_are_whole_pages_not_whole_huge_pages():
    """Without huge pages a block is rounded to 4 KiB pages, not 2 MiB (the rounding cost
    SmolLM2's weights ~120 MiB of resident memory); with them, to whole 2 MiB pages."""
    live0 = ops.cpu_allocator_stats()["live_bytes"]
    x = torch.empty(3 * MiB // 2 + 100, dtype=torch.uint8)  # 1.5 MiB + 100 B
    assert ops.cpu_allocator_stats()["live_bytes"] - live0 == 3 * MiB // 2 + 4096
    del x
    ops.cpu_allocator_empty_cache()
    ops.install_cpu_allocator(DEFAULT_ALLOCATOR_MIN_BYTES, DEFAULT_ALLOCATOR_CACHE_BYTES, True)
    y = torch.empty(3 * MiB // 2 + 100, dtype=torch.uint8)
    assert ops.cpu_allocator_stats()["live_bytes"] - live0 == 2 * MiB
    assert y.data_ptr() % (2 * MiB) == 0


def test_huge_pages_setting():
    assert ops.cpu_allocator_stats()["huge_pages"] == 0  # the default: no synchronous compaction
    ops.install_cpu_allocator(DEFAULT_ALLOCATOR_MIN_BYTES, DEFAULT_ALLOCATOR_CACHE_BYTES, True)
    assert ops.cpu_allocator_stats()["huge_pages"] == 1
    x = torch.full((3 * MiB,), 2.0)  # a new block, advised MADV_HUGEPAGE
    assert x.data_ptr() % (2 * MiB) == 0 and float(x.sum()) == 6 * MiB


def test_fork_child_allocates():
    x = torch.ones(4 * MiB)
    pid = os.fork()
    if pid == 0:  # child: the allocator's lock must be usable here
        ok = float(torch.ones(4 * MiB).sum()) == 4 * MiB and float(x.sum()) == 4 * MiB
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_bad_cache_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_ALLOCATOR_CACHE", "lots")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ALLOCATOR_CACHE"):
        install_cpu_allocator()


def test_engine_installs_it_unless_disabled():
    code = ("import json, sys; from pagedllm import LLM; from pagedllm.kernels.cpu_ops import get_ops; "
            "llm = LLM('SmolLM2-135M-Instruct', num_threads=1, kv_cache_memory='64MiB'); "
            "print(json.dumps(get_ops().cpu_allocator_stats()))")
    for flag, installed in (("1", True), ("0", False)):
        env = dict(os.environ, PAGEDLLM_CPU_ALLOCATOR=flag, PAGEDLLM_CPU_ALLOCATOR_HUGEPAGES="1")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        if installed:
            assert stats["max_cached_bytes"] == DEFAULT_ALLOCATOR_CACHE_BYTES and stats["huge_pages"] == 1
            # NOTE: the KV cache is its own mmap (committed on use, worker/kv_memory.py), not in these
            # blocks; loading and the first steps went through the allocator
            assert stats["misses"] > 0 and stats["hits"] + stats["misses"] >= 10, stats
        else:
            assert stats == {}
