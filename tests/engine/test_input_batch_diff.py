"""The persistent InputBatch, updated step to step by the scheduler's output, against a fresh build.

Every step, the runner's persistent batch (rows kept across steps, block tables grown by their
new tail, rows freed on finish / preemption and handed to later requests) must give the same
input ids, positions, slot mapping, block tables, attention metadata and sampling metadata as an
``InputBatch`` built from nothing for that step alone. The runs add, finish, abort, preempt and
re-admit requests, and reorder the batch (priority policy, shuffled decodes).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_runner import ModelRunner, _decodes_first

from test_input_batch import V, _FakeModel, _assert_meta_equal, _random_params  # (same folder)


def _runner(bs: int, num_blocks: int) -> ModelRunner:
    return ModelRunner(_FakeModel(), num_blocks, bs, (1, 1, 4), torch.float32, V)


def _fresh_step(runner: ModelRunner, reqs):
    """``_prepare`` + sampling metadata of ``reqs`` through a brand-new InputBatch."""
    fresh = InputBatch(V, max_rows=1, max_blocks=1)
    keep = runner.input_batch
    runner.input_batch = fresh
    try:
        rows, width = fresh.update(reqs, runner._generator_for)
        prep = runner._prepare(reqs, rows, width)
        meta = fresh.sampling_metadata(rows)
    finally:
        runner.input_batch = keep
    return prep, meta


@pytest.mark.parametrize("seed", range(5))
def test_persistent_batch_equals_fresh_build_every_step(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    num_blocks = rng.choice([14, 30, 200])
    max_model_len = min(40, (num_blocks - 1) * bs)
    mgr = KVCacheManager(num_blocks, bs, enable_caching=rng.random() < 0.5, hash_seed=0,
                         max_model_len=max_model_len)
    sched = Scheduler(max_num_seqs=rng.choice([3, 6, 12]), max_num_batched_tokens=rng.choice([12, 64]),
                      max_model_len=max_model_len, kv_cache_manager=mgr, debug=True, policy="priority")
    runner = _runner(bs, num_blocks)
    saw = {"preempt": 0, "reorder": 0, "reuse_row": 0, "finish": 0}
    next_id = 0
    prev_order: list[str] = []
    for _ in range(150):
        if rng.random() < 0.4:
            rid, next_id = f"r{next_id}", next_id + 1
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 20))][:max_model_len - 2]
            req = Request(rid, prompt, _random_params(rng), eos_token_id=None, priority=rng.randint(0, 3))
            sched.add_request(req)
        so = sched.schedule()
        saw["preempt"] += bool(so.preempted_req_ids)
        # The runner's own bookkeeping, as ModelRunner.execute does it.
        for rid in so.finished_req_ids | so.preempted_req_ids:
            runner.input_batch.remove(rid)
        if so.scheduled:
            reqs = _decodes_first(so.scheduled)
            decodes = [r for r in reqs if r.num_tokens == 1]
            if len(decodes) > 1 and rng.random() < 0.5:  # any order of the decodes is a valid batch
                rest = reqs[len(decodes):]
                rng.shuffle(decodes)
                reqs = decodes + rest
            order = [r.req_id for r in reqs]
            common = [r for r in order if r in prev_order]
            saw["reorder"] += common != [r for r in prev_order if r in order]
            prev_order = order
            free_before = list(runner.input_batch._free_rows)
            rows, width = runner.input_batch.update(reqs, runner._generator_for)
            saw["reuse_row"] += any(int(r) in free_before for r in rows)
            got = runner._prepare(reqs, rows, width)
            got_meta = runner.input_batch.sampling_metadata(rows)
            want, want_meta = _fresh_step(runner, reqs)
            for a, b in zip(got[:2], want[:2]):
                assert torch.equal(a, b)
            ma, mb = got[2], want[2]
            for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
                assert torch.equal(getattr(ma, f), getattr(mb, f)), f
            for f in ("num_reqs", "num_decodes", "query_lens", "seq_lens_list", "max_seq_len"):
                assert getattr(ma, f) == getattr(mb, f), f
            assert np.array_equal(got[3], want[3])
            if got_meta is None or want_meta is None:
                assert got_meta is None and want_meta is None
            else:
                _assert_meta_equal(got_meta, want_meta)
        ro = ModelRunnerOutput()
        for r in so.scheduled:
            if r.is_last_chunk:
                ro.sampled_token_ids[r.req_id] = [rng.randrange(V)]
        for o in sched.update_from_output(so, ro):
            saw["finish"] += o.finish_reason is not None
        if sched.running and rng.random() < 0.05:
            sched.finish_requests(rng.choice(sched.running).request_id, RequestStatus.FINISHED_ABORTED)
        # The batch holds a row for exactly the requests it was given that have not left.
        assert set(runner.input_batch.row_of) <= set(sched.requests) | sched.finished_req_ids
    assert saw["reorder"] and saw["reuse_row"] and saw["finish"], saw


def test_persistent_batch_state_is_bounded_by_live_requests():
    """Rows of finished requests are reused: the row count stays at the most live requests."""
    runner = _runner(2, 64)
    mgr = KVCacheManager(64, 2, enable_caching=False, max_model_len=32)
    sched = Scheduler(4, 64, 32, mgr, debug=True)
    for i in range(40):
        sched.add_request(Request(f"q{i}", [1 + i % 7, 2, 3], SamplingParams(max_tokens=3, temperature=0.0)))
    while sched.has_unfinished_requests() or sched.finished_req_ids:
        so = sched.schedule()
        for rid in so.finished_req_ids | so.preempted_req_ids:
            runner.input_batch.remove(rid)
        if so.scheduled:
            runner.input_batch.update(_decodes_first(so.scheduled), runner._generator_for)
        ro = ModelRunnerOutput()
        for r in so.scheduled:
            if r.is_last_chunk:
                ro.sampled_token_ids[r.req_id] = [5]
        sched.update_from_output(so, ro)
        assert runner.input_batch.num_live <= 4
    assert runner.input_batch._num_rows_used <= 4 and runner.input_batch.num_live == 0


@pytest.mark.parametrize("seed", range(4))
def test_flat_decode_steps_equal_the_general_form(seed):
    """``SchedulerOutput``'s flat form (steps of unchanged decodes) against the general form, in
    lockstep over the same requests: the ``ScheduledRequest``s built from the flat form, the
    runner's sampled tokens and logprobs (flat path vs ``ScheduledRequest`` path) and the
    scheduler's outputs are equal step for step."""
    rng = random.Random(100 + seed)
    bs = rng.choice([1, 2, 4])
    num_blocks = rng.choice([20, 200])
    max_model_len = min(40, (num_blocks - 1) * bs)
    pairs = []
    for flat in (True, False):
        mgr = KVCacheManager(num_blocks, bs, enable_caching=seed % 2 == 0, hash_seed=0, max_model_len=max_model_len)
        sched = Scheduler(max_num_seqs=rng.choice([4, 8]), max_num_batched_tokens=64, max_model_len=max_model_len,
                          kv_cache_manager=mgr, debug=True, policy="priority" if seed % 2 else "fcfs")
        sched._flat_ok = flat
        pairs.append((sched, _runner(bs, num_blocks)))
    num_flat = 0
    for step in range(120):
        if rng.random() < 0.25:
            rid = f"r{step}"
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
            params = _random_params(rng)
            if rng.random() < 0.2:
                params = SamplingParams(max_tokens=rng.randint(2, 10), ignore_eos=True, repetition_penalty=1.3,
                                        temperature=0.0)
            prio = rng.randint(0, 3)
            for sched, _ in pairs:
                sched.add_request(Request(rid, list(prompt), params.clone(), eos_token_id=None, priority=prio))
        got = []
        for sched, runner in pairs:
            so = sched.schedule()
            flat = so.is_flat and not so.is_empty
            torch.manual_seed(step)  # (unseeded rows draw from the global generator: the same draws)
            ro = runner.execute(so)
            blocks_now = [list(r.block_ids) for r in so.scheduled]
            got.append((flat, so, ro, blocks_now))
        (flat_a, so_a, ro_a, blk_a), (flat_b, so_b, ro_b, blk_b) = got
        assert not flat_b
        num_flat += flat_a
        assert so_a.scheduled == so_b.scheduled and blk_a == blk_b
        assert so_a.total_num_scheduled_tokens == so_b.total_num_scheduled_tokens
        assert ro_a.sampled_token_ids == ro_b.sampled_token_ids
        assert ro_a.logprobs == ro_b.logprobs
        outs = [sched.update_from_output(so, ro) for (sched, _), (_, so, ro, _) in zip(pairs, got)]
        assert outs[0] == outs[1]
        if pairs[0][0].running and rng.random() < 0.05:
            victim = rng.choice(pairs[0][0].running).request_id
            for sched, _ in pairs:
                sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    assert num_flat > 10
