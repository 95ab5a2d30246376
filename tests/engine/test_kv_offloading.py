"""OffloadingConnector through the engine (LLM) on a tiny random checkpoint: outputs with the
connector on equal outputs with it off while the KV pool is too small to keep the prefixes
(bitwise in batch-invariant mode), the disk tier outlives the engine, bad files and a full disk
fall back to recomputing, tier bounds hold, unsupported settings are refused."""
from __future__ import annotations

import logging
import os
import random

import pytest

from tiny_models import TINY_LLAMA_BLOCK_BYTES as BLOCK_BYTES, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm2_path):
    """Two tiny random LlamaForCausalLM checkpoints (different weights) with SmolLM2's tokenizer."""
    from pagedllm.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    return (save_tiny_llama(str(tmp_path_factory.mktemp("kvt_a")), tok, 5),
            save_tiny_llama(str(tmp_path_factory.mktemp("kvt_b")), tok, 6))


def _workload(n_docs=4, doc_len=96, n=12, seed=0):
    rng = random.Random(seed)
    docs = [[rng.randrange(100, 40000) for _ in range(doc_len)] for _ in range(n_docs)]
    return [{"prompt_token_ids": docs[i % n_docs] + [rng.randrange(100, 40000) for _ in range(7)]}
            for i in range(n)]


def _run(path, prompts, batch_invariant=False, **kw):
    """Outputs (tokens, logprobs, cached tokens) of each prompt run one after another, and the
    engine's connector stats."""
    from pagedllm import LLM, SamplingParams

    # 20 blocks of 16 tokens: one 103-token prompt takes 7, so the 4 documents (24 blocks) cannot
    # all stay cached and each comes back after 3 others: evicted from the device every time.
    llm = LLM(path, dtype="float32", kv_cache_memory=20 * BLOCK_BYTES, max_num_batched_tokens=128,
              max_num_seqs=2, seed=0, batch_invariant=batch_invariant, **kw)
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    outs = []
    try:
        for p in prompts:
            o = llm.generate(p, sp, use_tqdm=False)[0]
            c = o.outputs[0]
            outs.append((c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs],
                         o.num_cached_tokens))
        conn = llm.llm_engine.core.kv_connector
    finally:
        llm.llm_engine.core.shutdown()  # NOTE: carries out the last saves and flushes the disk writer
    return outs, (conn.get_kv_connector_stats() if conn is not None else None)


def _close(a, b):
    for (ta, la, _), (tb, lb, _) in zip(a, b):
        assert ta == tb
        for da, db in zip(la, lb):
            assert [t for t, _ in da] == [t for t, _ in db]
            assert max(abs(x - y) for (_, x), (_, y) in zip(da, db)) < 1e-4


def test_host_tier_outputs_match_and_evicted_prefixes_load(tiny_dirs):
    prompts = _workload()
    off, none = _run(tiny_dirs[0], prompts)
    assert none is None
    assert all(c == 0 for _, _, c in off)  # the pool is too small: nothing survives on the device
    on, st = _run(tiny_dirs[0], prompts, kv_offloading_size=0.01)
    _close(off, on)
    assert [c for _, _, c in on] == [0] * 4 + [96] * 8  # each document's 6 full blocks come back
    host = st["tiers"]["host"]
    assert host["loads"] == 8 * 6 and host["load_bytes"] == 8 * 6 * BLOCK_BYTES
    assert host["saves"] == 4 * 6 + 8 * 0 and host["bytes"] == host["blocks"] * BLOCK_BYTES
    assert st["hit_tokens"] == 8 * 96 and "disk" not in st["tiers"]


def test_batch_invariant_logprobs_bitwise(tiny_dirs):
    prompts = _workload(n=8, seed=1)
    off, _ = _run(tiny_dirs[0], prompts, batch_invariant=True)
    on, st = _run(tiny_dirs[0], prompts, batch_invariant=True, kv_offloading_size=0.01)
    assert [o[:2] for o in on] == [o[:2] for o in off]
    assert st["hit_tokens"] > 0


def test_host_tier_bound(tiny_dirs):
    prompts = _workload()
    cap_blocks = 5
    on, st = _run(tiny_dirs[0], prompts, kv_offloading_size=cap_blocks * BLOCK_BYTES / 1024**3)
    host = st["tiers"]["host"]
    assert host["capacity_bytes"] == int(cap_blocks * BLOCK_BYTES / 1024**3 * 1024**3)
    assert host["bytes"] <= host["capacity_bytes"] and host["blocks"] <= cap_blocks
    assert host["evictions"] > 0 and host["saves"] - host["evictions"] == host["blocks"]


def test_disk_tier_survives_the_engine_and_rejects_bad_files(tiny_dirs, tmp_path, caplog):
    prompts = _workload(n=4)
    d = str(tmp_path / "kv")
    off, _ = _run(tiny_dirs[0], prompts)
    first, st = _run(tiny_dirs[0], prompts, kv_cache_dir=d)
    assert st["tiers"]["disk"]["saves"] == 4 * 6 and st["tiers"]["disk"]["errors"] == 0
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs)
    assert len(files) == 24 and not any(f.endswith(".tmp") for f in files)
    # a new engine (a restart): every document is found on disk, the first request included
    again, st = _run(tiny_dirs[0], prompts, kv_cache_dir=d)
    _close(off, again)
    assert [c for _, _, c in again] == [96] * 4
    assert st["tiers"]["disk"]["loads"] == 24 and st["tiers"]["disk"]["saves"] == 0
    # another model sharing the directory: its own namespace, no hits, no errors
    other, st = _run(tiny_dirs[1], prompts, kv_cache_dir=d)
    assert [c for _, _, c in other] == [0] * 4 and st["tiers"]["disk"]["errors"] == 0
    # corrupt (one byte), truncate, and plant another model's file under this model's names
    mine = sorted(f for f in files)
    theirs = sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if os.path.join(r, f) not in files)
    assert len(theirs) == 24
    for f in mine[0::3]:
        with open(f, "r+b") as fh:
            fh.seek(-10, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-10, os.SEEK_END)
            fh.write(bytes([b[0] ^ 1]))
    for f in mine[1::3]:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 7)
    for i, f in enumerate(mine[2::3]):
        os.replace(theirs[i], f)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        bad, st = _run(tiny_dirs[0], prompts, kv_cache_dir=d)
    _close(off, bad)  # recomputed, never a wrong token
    assert st["tiers"]["disk"]["errors"] > 0
    # Every file is tampered with one of three ways (assigned by the order of their hashed names, which
    # follow the model's path): a document's chain stops at its first bad block, so which kinds get read
    # varies from run to run (all four first blocks among the planted files: ~1 run in 80). Each kind's
    # own message is checked file by file in tests/kv_transfer/test_kv_tiers.py.
    assert any(w in caplog.text for w in ("checksum", "truncated", "fingerprint differs")), caplog.text
    # the blocks that were recomputed were written again: the next engine hits them all
    healed, st = _run(tiny_dirs[0], prompts, kv_cache_dir=d)
    _close(off, healed)
    assert [c for _, _, c in healed] == [96] * 4 and st["tiers"]["disk"]["errors"] == 0


def test_producer_and_consumer_roles(tiny_dirs, tmp_path):
    prompts = _workload(n=4)
    d = str(tmp_path / "kv")

    def cfg(role):
        return {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": role,
                                       "kv_connector_extra_config": {"kv_cache_dir": d}}}

    off, _ = _run(tiny_dirs[0], prompts)
    empty, st = _run(tiny_dirs[0], prompts, **cfg("kv_consumer"))  # nothing there yet, and saves nothing
    assert [c for _, _, c in empty] == [0] * 4 and st["tiers"]["disk"]["saves"] == 0
    assert not [f for _, _, fs in os.walk(d) for f in fs]
    made, st = _run(tiny_dirs[0], prompts + prompts, **cfg("kv_producer"))  # saves, never loads
    assert st["tiers"]["disk"]["saves"] == 24 and st["hit_tokens"] == 0
    used, st = _run(tiny_dirs[0], prompts, **cfg("kv_consumer"))
    _close(off, used)
    assert [c for _, _, c in used] == [96] * 4 and st["tiers"]["disk"]["saves"] == 0


def test_full_disk_degrades_to_recompute(tiny_dirs, tmp_path, monkeypatch, caplog):
    from pagedllm.distributed.kv_transfer.tiers import DiskTier

    real = DiskTier._open_tmp
    monkeypatch.setattr(DiskTier, "_open_tmp", lambda self, path: (real(self, path)[0], open("/dev/full", "wb")))
    prompts = _workload(n=8)
    off, _ = _run(tiny_dirs[0], prompts)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        on, st = _run(tiny_dirs[0], prompts, kv_cache_dir=str(tmp_path / "kv"), kv_offloading_size=0.01)
    _close(off, on)
    assert "disk full" in caplog.text
    disk = st["tiers"]["disk"]
    assert disk["errors"] == 24 and disk["saves"] == 0 and disk["blocks"] == 0
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert st["tiers"]["host"]["loads"] > 0  # the host tier still serves


def test_disk_tier_bound_through_the_engine(tiny_dirs, tmp_path):
    d = str(tmp_path / "kv")
    # a bound of ~10 block files (a file is the block plus a ~300-byte header)
    on, st = _run(tiny_dirs[0], _workload(), kv_cache_dir=d, kv_cache_dir_size=10.5 * (BLOCK_BYTES + 400) / 1024**3)
    disk = st["tiers"]["disk"]
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    assert size == disk["bytes"] <= disk["capacity_bytes"] and disk["evictions"] > 0
    assert disk["blocks"] == sum(len(fs) for _, _, fs in os.walk(d)) <= 10


def test_refused_settings(tiny_dirs):
    from pagedllm import LLM

    for kw, field in [({"enable_prefix_caching": False}, "prefix caching"),
                      ({"kv_transfer_config": {"kv_connector": "Nope"}}, "kv_connector"),
                      ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                               "kv_connector_extra_config": {"cpu_bytes": 1}}}, "unknown key"),
                      ({"kv_offloading_backend": "lmcache", "kv_offloading_size": 1}, "kv_offloading_backend"),
                      ({"tensor_parallel_size": 2}, "one in-process rank")]:
        with pytest.raises(ValueError, match=field):
            LLM(tiny_dirs[0], dtype="float32", kv_cache_memory=20 * BLOCK_BYTES, **{"kv_offloading_size": 0.01, **kw})


def test_generate_saves_its_last_request_without_shutdown(tiny_dirs, tmp_path):
    from pagedllm import LLM, SamplingParams

    llm = LLM(tiny_dirs[0], dtype="float32", kv_cache_memory=20 * BLOCK_BYTES, kv_cache_dir=str(tmp_path / "kv"))
    try:
        llm.generate(_workload(n=1)[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        conn = llm.llm_engine.core.kv_connector
        assert not llm.llm_engine.core.scheduler.has_pending_kv_transfers()
        assert conn.disk.flush(30)
        assert sum(len(fs) for _, _, fs in os.walk(tmp_path)) == 6 == conn.get_kv_connector_stats()["tiers"]["disk"]["saves"]
    finally:
        llm.llm_engine.core.shutdown()
