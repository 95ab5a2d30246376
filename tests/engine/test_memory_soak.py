"""Memory under sustained traffic (issue 25): per-request state is dropped when a request ends,
and resident memory stays flat over a few hundred mixed requests, offline and through the server.

The leak these catch: the caching CPU allocator dropped (never freed) the small blocks oneDNN
allocates through ``raw_allocate`` (~0.5 MiB per engine step of a bf16 model on CPUs where
oneDNN runs bf16 linears: the default on AVX512-BF16 / AMX machines). The allocator's own test
(tests/kernels/test_cpu_allocator.py) reproduces it on any CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import weakref

import httpx
import pytest

from pagedllm.metrics.memory import resident_memory_bytes

MiB = 1 << 20
SOAK_MARGIN = 64 * MiB


def _prompts(rng, k: int) -> list[str]:
    words = "river mountain garden music story city light water history science market".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(k)]


def _mixed_round(llm, rng, round_no: int) -> None:
    """One batch of 10 requests: greedy, seeded sampling with logprobs, n=2, a stop string, a
    prompt_logprobs request, a 2,000-character prompt every 5th round, and an aborted request."""
    from pagedllm import SamplingParams

    eng = llm.llm_engine
    ps = _prompts(rng, 8)
    params = [SamplingParams(temperature=0, max_tokens=6),
              SamplingParams(temperature=0.8, top_p=0.9, seed=round_no, max_tokens=6, logprobs=3),
              SamplingParams(temperature=0.7, n=2, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=8, stop=[" the", "."]),
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2, min_tokens=2),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=6)]
    if round_no % 5 == 0:
        ps[0] = " ".join(_prompts(rng, 120))[:2000]  # ~450 tokens: two 256-token chunks
    # A request aborted halfway: added, stepped with the batch, then dropped by the caller.
    eng.add_request(f"abort-{round_no}", ps[1], SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    eng.abort_request([f"abort-{round_no}"])
    outs = llm.generate(ps, params, use_tqdm=False)
    assert len(outs) == 8 and all(o.finished for o in outs)
    eng.step()  # an empty step hands the last finished ids to the runner, which frees their state


@pytest.mark.slow
def test_offline_state_and_resident_memory_stay_flat():
    import random

    from pagedllm import LLM

    # The default dtype (bf16 where the CPU has native bf16, as users run it).
    llm = LLM("SmolLM2-135M-Instruct", kv_cache_memory="128MiB", max_num_batched_tokens=256, seed=0,
              kv_prefix_cache_memory="16MiB")
    core = llm.llm_engine.core
    pool = core.kv_cache_manager.block_pool
    keep = core.kv_prefix_keep_blocks
    assert keep == 16 * MiB // core.kv_block_bytes and pool.num_committed_blocks == 0
    peak_live = [0]
    take = pool.get_new_blocks

    def get_new_blocks(n):  # records the most blocks ever held by requests at once
        out = take(n)
        peak_live[0] = max(peak_live[0], pool.num_usable_blocks - pool.get_num_free_blocks())
        return out

    pool.get_new_blocks = get_new_blocks
    rng = random.Random(0)
    for r in range(6):  # warm-up: malloc arenas, allocator blocks, oneDNN primitives
        _mixed_round(llm, rng, r)
    counts = llm.llm_engine.get_request_state_counts()
    assert all(v == 0 for v in counts.values()), counts
    rss0 = resident_memory_bytes()
    for r in range(6, 26):  # 20 rounds x 10 requests
        _mixed_round(llm, rng, r)
    grown = resident_memory_bytes() - rss0
    counts = llm.llm_engine.get_request_state_counts()
    assert all(v == 0 for v in counts.values()), counts
    mem = llm.llm_engine.core.get_memory_stats()
    if "cpu_allocator_cached_bytes" in mem:
        assert mem["cpu_allocator_cached_bytes"] <= mem["cpu_allocator_cache_limit_bytes"]
    assert grown < SOAK_MARGIN, f"resident memory grew by {grown / MiB:.1f} MiB over 200 requests"
    # Committed KV (issue 30) is bounded by the peak of live blocks plus the kept prefixes, well
    # inside the pool: committed blocks are reused before never-used ones, however many requests ran.
    committed = pool.num_committed_blocks
    assert committed <= peak_live[0] + keep < pool.num_usable_blocks, (committed, peak_live[0], keep)
    assert mem["kv_cache_committed_bytes"] == committed * core.kv_block_bytes
    pool.check_invariants()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_server_resident_memory_stays_flat_under_the_mixed_soak():
    """``pagedllm bench serve --dataset-name mixed`` against ``pagedllm serve`` (default dtype):
    the server's resident memory (its /metrics process_resident_memory_bytes) after 120 more
    requests is within the margin of its value after 40 warm-up requests, not counting the KV
    pages committed meanwhile (issue 30: they are committed as blocks are first used, at most the
    128 MiB reserved), and every request succeeded; idle, committed KV falls back to the kept
    prefixes."""
    from pagedllm.entrypoints.bench_serve import add_bench_serve_args, benchmark

    port = _free_port()
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1", PAGEDLLM_IDLE_RELEASE_S="3")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
         "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--max-num-batched-tokens", "256",
         "--kv-prefix-cache-memory", "16MiB", "--disable-log-requests"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.3)
        args = add_bench_serve_args(argparse.ArgumentParser()).parse_args(
            # Long prompts of 2,000 characters (~450 tokens: two 256-token prefill chunks): the
            # default 5,000 made this the slowest test of the suite (129 s of a Zen 1 run).
            ["--base-url", base, "--dataset-name", "mixed", "--num-prompts", "160", "--max-tokens", "8",
             "--mixed-long-prompt-chars", "2000",
             "--max-concurrency", "8", "--warmup-requests", "40", "--memory-samples", "4"])
        m = asyncio.run(benchmark(args))
        assert m["failed"] == 0, [e for e in m["errors"] if e][:3]
        assert [x["requests_done"] for x in m["memory_samples"]] == [40, 70, 100, 130, 160]
        samples = m["memory_samples"]
        kv_grown = samples[-1]["kv_cache_committed_bytes"] - samples[0]["kv_cache_committed_bytes"]
        assert 0 <= samples[-1]["kv_cache_committed_bytes"] <= 128 * MiB, samples
        metrics = httpx.get(base + "/metrics").text
        assert "pagedllm:cpu_allocator_cached_bytes" in metrics
        assert "process_resident_memory_bytes" in metrics
        # Idle (release after 3 s): committed KV is back within the 16 MiB of kept prefixes.
        time.sleep(6)
        metrics = httpx.get(base + "/metrics").text
        reserved = _gauge(metrics, "pagedllm:kv_cache_bytes")
        committed = _gauge(metrics, "pagedllm:kv_cache_committed_bytes")
        assert reserved >= 127 * MiB and 0 < committed <= 16 * MiB, (reserved, committed)
        # NOTE: checked last: this also failed on main (30fde32) on an AVX512-BF16 host (+156 MiB).
        grown = m["resident_memory_end_bytes"] - m["resident_memory_after_warmup_bytes"] - kv_grown
        assert grown < SOAK_MARGIN, (f"server resident memory grew by {grown / MiB:.1f} MiB besides "
                                     f"{kv_grown / MiB:.1f} MiB of KV pages", samples)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _gauge(text: str, name: str) -> float:
    import re
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_default_kv_cache_is_what_the_sequences_can_use():
    """No kv_cache_memory: the cache holds max_num_seqs x max_model_len tokens (+ the null
    block) when that is less than the 2 GiB default, not 2 GiB."""
    from pagedllm import LLM

    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", max_num_seqs=3, max_model_len=200)
    core = llm.llm_engine.core
    assert core.num_blocks == 3 * 13 + 1  # ceil(200 / 16) = 13 blocks per sequence
    assert core.kv_cache_bytes == core.num_blocks * 16 * (2 * 30 * 3 * 64 * 4)
    out = llm.generate(["one two three"] * 3, use_tqdm=False)
    assert all(o.finished for o in out)
    mem = core.get_memory_stats()
    assert mem["kv_cache_bytes"] == core.kv_cache_bytes and mem["weight_bytes"] == core.weight_bytes


class _Cycle:
    """A reference cycle holding 4 MiB, freed only by the cyclic garbage collector."""

    def __init__(self) -> None:
        self.me, self.payload = self, bytearray(4 * MiB)


def test_idle_server_engine_returns_its_free_blocks(monkeypatch, caplog):
    """After a burst, an idle AsyncLLM returns the allocator's free blocks and free heap to the
    OS (once per idle period of PAGEDLLM_IDLE_RELEASE_S); start-up logs the memory plan."""
    import logging

    from pagedllm import SamplingParams
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.kernels.cpu_ops import cpu_allocator_stats

    monkeypatch.setenv("PAGEDLLM_IDLE_RELEASE_S", "0.5")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        eng = AsyncLLM(EngineArgs(model="SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="64MiB",
                                  max_num_batched_tokens=1024, kv_prefix_cache_memory="8MiB"))
    assert any("memory plan: weights" in r.getMessage() and "resident now" in r.getMessage()
               for r in caplog.records)
    try:
        async def burst():
            long = " ".join(["river mountain garden music story"] * 150)  # a ~750-token prefill
            async for _ in eng.generate(long, SamplingParams(max_tokens=2, temperature=0), "r1"):
                pass
            mid = cpu_allocator_stats().get("cached_bytes")
            committed = eng.get_memory_stats()["kv_cache_committed_bytes"]
            cycle = _Cycle()  # cyclic garbage left by the burst: the release collects it
            ref = weakref.ref(cycle)
            del cycle
            await asyncio.sleep(2.5)  # idle: the engine thread releases after 0.5 s
            return mid, committed, ref
        mid, committed_mid, garbage = asyncio.run(burst())
        assert garbage() is None  # collected (the start-up heap is frozen, young collections rare)
        # KV pages (issue 30): the ~750-token prompt committed ~47 blocks of 720 KiB; idle, all
        # but the 8 MiB of most recently used cached prefixes (11 blocks) went back.
        block = eng.engine.core.kv_block_bytes
        assert block == 16 * 2 * 30 * 3 * 64 * 4
        assert committed_mid >= 45 * block, committed_mid
        assert eng.get_memory_stats()["kv_cache_committed_bytes"] == 8 * MiB // block * block
        assert any("reserved (0.0 MiB committed now" in r.getMessage() for r in caplog.records)
        after = cpu_allocator_stats()
        # The prefill chunk's workspace went back at the first decode step, and what was left
        # when the batch emptied (Worker.trim_workspace), before the idle release.
        trimmer = eng.engine.core.executor.driver_worker.workspace_trimmer
        assert trimmer.trims >= 2 and not trimmer.dirty, trimmer.trims
        if after:  # the caching allocator is installed (C++ kernels built)
            # (the batch-empty trim gives back every free block, so ``mid`` may already be 0)
            assert mid is not None and trimmer.trimmed_bytes > 0, (mid, trimmer.trimmed_bytes)
            assert after["cached_bytes"] == 0
        counts = eng.engine.get_request_state_counts()
        assert all(v == 0 for v in counts.values()), counts  # finished ids were handed to the runner
    finally:
        eng.shutdown()
