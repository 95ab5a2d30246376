"""The engine's KV cache committed on use (issue 30, items 1 and 5): outputs identical to the
zero-filled cache, resident KV following the blocks in use and returning after the release, and
the KV budget sized from free memory with clear errors for bad sizes."""
from __future__ import annotations

import pytest
from arch_cases import PROMPTS, make_checkpoint

from pagedllm import LLM, SamplingParams

from pagedllm.metrics.memory import anon_resident_bytes as rss_anon

MiB = 1 << 20



def _run(llm, prompts, release_between: bool):
    """Greedy tokens and sampled-token logprobs (5 alternatives) of ``prompts``, twice, with no
    prefix cached for the second round: after giving every free block's pages back (which drops
    their prefixes), or after ``reset_prefix_cache``. Either way the second round recomputes,
    the lazy cache on blocks whose pages were dropped."""
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    # NOTE: a shared engine may hold prefixes of earlier tests; a hit changes the chunking (and so
    # the float rounding), so both runs start from an empty prefix cache.
    assert llm.llm_engine.core.kv_cache_manager.reset_prefix_cache()
    out = []
    for _ in range(2):
        for o in llm.generate(prompts, sp, use_tqdm=False):
            c = o.outputs[0]
            out.append((list(c.token_ids), [sorted((k, v.logprob) for k, v in d.items()) for d in c.logprobs]))
        core = llm.llm_engine.core
        if release_between:
            assert core.release_kv_pages(max_cached_kept=0) > 0
            assert core.kv_cache_manager.block_pool.num_committed_blocks == 0
            assert not core.kv_cache_manager.block_pool.cached_block_hash_to_block
        else:
            assert core.kv_cache_manager.reset_prefix_cache()
    return out


def test_tiny_model_outputs_identical_to_zero_filled_cache(tmp_path, monkeypatch):
    make_checkpoint("llama", str(tmp_path))
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=8, kv_cache_memory=2 * MiB)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    lazy = LLM(str(tmp_path), **kw)
    assert lazy.llm_engine.core.runner.kv_caches[0]._kv_mmap is not None
    got = _run(lazy, prompts, release_between=True)
    monkeypatch.setenv("PAGEDLLM_KV_LAZY", "0")
    zeros = LLM(str(tmp_path), **kw)
    assert getattr(zeros.llm_engine.core.runner.kv_caches[0], "_kv_mmap", None) is None
    want = _run(zeros, prompts, release_between=False)
    assert got == want  # tokens and logprobs, bit for bit


@pytest.mark.slow
def test_smollm2_outputs_identical_to_zero_filled_cache(smollm2_llm, monkeypatch):
    prompts = ["The capital of France is", "def fibonacci(n):",
               " ".join(["river mountain garden music story"] * 60)]
    got = _run(smollm2_llm, prompts, release_between=True)
    monkeypatch.setenv("PAGEDLLM_KV_LAZY", "0")
    zeros = LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=256 * MiB,
                max_num_batched_tokens=512, seed=0, quantization="none")
    want = _run(zeros, prompts, release_between=False)
    assert got == want


@pytest.mark.slow
def test_resident_kv_follows_blocks_and_returns_after_release():
    """The pool's committed counter, the cache's own page count (mincore) and the process's RssAnon
    agree: nothing at start-up, the blocks a long prompt used after it, nothing after the release."""
    before = rss_anon()
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="1GiB", max_num_batched_tokens=512,
              kv_prefix_cache_memory=0)
    core = llm.llm_engine.core
    worker = core._driver_worker()
    pool = core.kv_cache_manager.block_pool
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4  # 737,280 bytes = 180 pages (float32 SmolLM2)
    assert core.kv_block_bytes == block_bytes and core.kv_cache_bytes == core.num_blocks * block_bytes
    assert core.kv_cache_bytes > 1000 * MiB
    assert pool.num_committed_blocks == 0 and worker.kv_resident_bytes() == 0
    assert core.get_memory_stats()["kv_cache_committed_bytes"] == 0
    assert rss_anon() - before < 700 * MiB  # a 1 GiB cache reserved, weights loaded, not committed

    prompt = " ".join(["river mountain garden music story"] * 300)  # ~1,500 tokens: ~94 blocks
    anon0 = rss_anon()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    n = pool.num_committed_blocks
    assert 90 <= n <= 100, n
    assert core.get_memory_stats()["kv_cache_committed_bytes"] == n * block_bytes
    assert worker.kv_resident_bytes() == n * block_bytes  # every committed page written, no other
    grown = rss_anon() - anon0
    assert grown > 0.9 * n * block_bytes, (grown, n * block_bytes)

    # A second, shorter request reuses committed blocks: nothing new is committed.
    llm.generate([prompt[:2000]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert pool.num_committed_blocks == n and worker.kv_resident_bytes() == n * block_bytes

    anon1 = rss_anon()
    assert core.release_kv_pages() == n  # kv_prefix_cache_memory=0: every free block goes
    assert pool.num_committed_blocks == 0 and worker.kv_resident_bytes() == 0
    assert core.get_memory_stats()["kv_cache_committed_bytes"] == 0
    assert anon1 - rss_anon() > 0.9 * n * block_bytes
    pool.check_invariants()
    # And it still serves, committing again.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].finished and pool.num_committed_blocks == n


@pytest.mark.slow
def test_kept_prefix_budget_survives_release_and_still_hits():
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=512,
              kv_prefix_cache_memory="20MiB")
    core = llm.llm_engine.core
    pool = core.kv_cache_manager.block_pool
    keep = 20 * MiB // core.kv_block_bytes  # 28 blocks of 720 KiB
    assert core.kv_prefix_keep_blocks == keep == 28
    long_a = " ".join(["river mountain garden music story"] * 150)  # ~750 tokens: ~47 blocks
    long_b = " ".join(["ocean library engine signal harvest"] * 150)
    sp = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([long_a], sp, use_tqdm=False)
    llm.generate([long_b], sp, use_tqdm=False)
    core.release_kv_pages()
    assert pool.num_committed_blocks == keep  # the 28 most recently used cached blocks (long_b's)
    hits0 = core.scheduler.prefix_cache_hits
    llm.generate([long_b], sp, use_tqdm=False)
    assert core.scheduler.prefix_cache_hits - hits0 >= 16 * (keep - 2)  # its kept prefix hit
    pool.check_invariants()


def test_zero_and_too_large_kv_cache_memory_fail_before_loading(monkeypatch):
    from pagedllm.executor import Executor

    def no_load(args):
        raise AssertionError("the model was about to load")

    monkeypatch.setattr(Executor, "get_class", staticmethod(no_load))
    with pytest.raises(ValueError, match=r"kv_cache_memory \(--kv-cache-memory\): size must be positive"):
        LLM("SmolLM2-135M-Instruct", kv_cache_memory=0)
    with pytest.raises(ValueError, match=r"kv_cache_memory \(--kv-cache-memory\): \S+ GiB is more than this "
                                         r"machine's memory \(MemTotal .*; use at most"):
        LLM("SmolLM2-135M-Instruct", kv_cache_memory="100TiB")
    with pytest.raises(ValueError, match=r"kv_prefix_cache_memory \(--kv-prefix-cache-memory\)"):
        LLM("SmolLM2-135M-Instruct", kv_prefix_cache_memory="lots")
    with pytest.raises(ValueError, match="max_model_len: expected a positive integer or 'auto'"):
        LLM("SmolLM2-135M-Instruct", max_model_len="big")
    with pytest.raises(ValueError, match="max_model_len: must be >= 1 or 'auto'"):
        LLM("SmolLM2-135M-Instruct", max_model_len=0)


def test_cli_flags_parse():
    import argparse

    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    p = make_arg_parser(argparse.ArgumentParser())
    a = p.parse_args(["--max-model-len", "auto", "--kv-prefix-cache-memory", "0"])
    assert a.max_model_len is None and a.kv_prefix_cache_memory == 0
    assert p.parse_args(["--max-model-len", "-1"]).max_model_len is None
    assert p.parse_args(["--max-model-len", "4096", "--kv-prefix-cache-memory", "32MiB"]).kv_prefix_cache_memory == 32 * MiB
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-memory", "0"])


def test_auto_budget_from_mem_available(monkeypatch, tmp_path):
    """No kv_cache_memory: half of MemAvailable (here faked to 64 MiB -> 32 MiB), as long as the
    sequences can use that much; max_model_len "auto" = what that holds, up to the model's context."""
    import pagedllm.metrics.memory as memory

    make_checkpoint("llama", str(tmp_path))
    monkeypatch.setattr(memory, "read_meminfo", lambda: {"MemTotal": 1 << 34, "MemAvailable": 64 * MiB})
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_model_len="auto", max_num_seqs=4096)
    core = llm.llm_engine.core
    bytes_per_block = core.kv_block_bytes
    assert core.num_blocks == 32 * MiB // bytes_per_block
    assert core.max_model_len == min(int(core.hf_config.max_position_embeddings), (core.num_blocks - 1) * 4)
    # Few sequences: the budget is what they can fill, not the free-memory share.
    small = LLM(str(tmp_path), dtype="float32", block_size=4, max_model_len=32, max_num_seqs=2)
    assert small.llm_engine.core.num_blocks == 2 * 8 + 1
