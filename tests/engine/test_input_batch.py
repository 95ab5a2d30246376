"""The runner's persistent InputBatch against the straightforward per-step construction.

* ``ModelRunner._prepare`` (persistent block tables, vectorised positions / slots) equals the
  per-request construction it replaced, step for step, over random runs of a real Scheduler with
  new requests, chunked prefills, prefix hits, preemption, aborts and request-id reuse.
* ``InputBatch.sampling_metadata`` equals ``SamplingMetadata.from_requests`` for simple rows
  and declines (None) when a row needs the per-row path.
* ``ModelRunner.execute`` samples the same tokens and logprobs through either path.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, is_simple_sampling
from pagedllm.worker.model_runner import ModelRunner, _decodes_first

torch.set_num_threads(1)
V = 64


class _FakeModel(torch.nn.Module):
    """hidden = one row per token (a deterministic function of id and position); logits = a
    fixed random projection, so every step has well-defined, varied logits."""

    def __init__(self, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, hidden, generator=g)
        self.head = torch.randn(hidden, V, generator=g) * 3

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.emb[input_ids] + torch.sin(positions.float()).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head


def _runner(block_size: int, num_blocks: int = 64, seed: int = 0) -> ModelRunner:
    return ModelRunner(_FakeModel(seed=seed), num_blocks, block_size, (1, 1, 4), torch.float32, V)


def _reference_prepare(reqs: list[ScheduledRequest], bs: int):
    """The per-request construction ``_prepare`` replaced (kept verbatim as the oracle)."""
    query_lens = [r.num_tokens for r in reqs]
    total = sum(query_lens)
    ids = np.empty(total, dtype=np.int64)
    pos = np.empty(total, dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    max_blocks = max(len(r.block_ids) for r in reqs)
    block_tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
    seq_lens = []
    off = 0
    for i, r in enumerate(reqs):
        n, s = r.num_tokens, r.start_pos
        ids[off:off + n] = r.token_ids[s:s + n]
        p = np.arange(s, s + n, dtype=np.int64)
        pos[off:off + n] = p
        bt = np.asarray(r.block_ids, dtype=np.int64)
        block_tables[i, :len(bt)] = bt
        slots[off:off + n] = bt[p // bs] * bs + p % bs
        seq_lens.append(s + n)
        off += n
    qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    num_decodes = 0
    for q in query_lens:
        if q != 1:
            break
        num_decodes += 1
    return ids, pos, slots, block_tables, seq_lens, qsl, num_decodes, query_lens


def _assert_prepare_matches(runner: ModelRunner, so: SchedulerOutput) -> None:
    for rid in so.finished_req_ids | so.preempted_req_ids:
        runner.input_batch.remove(rid)
    if not so.scheduled:
        return
    reqs = _decodes_first(so.scheduled)
    assert [r.req_id for r in reqs] == [r.req_id for r in sorted(so.scheduled, key=lambda r: r.num_tokens != 1)]
    ids, pos, meta, qsl = runner._prepare(reqs)
    r_ids, r_pos, r_slots, r_bt, r_seq, r_qsl, r_nd, r_ql = _reference_prepare(reqs, runner.block_size)
    for got, want in ((ids, r_ids), (pos, r_pos), (meta.slot_mapping, r_slots),
                      (meta.block_tables, r_bt), (meta.query_start_loc, r_qsl)):
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.from_numpy(want)), (got, want)
    assert np.array_equal(qsl, r_qsl)
    assert meta.seq_lens.dtype == torch.int64 and meta.seq_lens.tolist() == r_seq
    assert meta.seq_lens_list == r_seq and meta.query_lens == r_ql
    assert meta.num_reqs == len(reqs) and meta.num_decodes == meta.num_decode_tokens == r_nd
    assert meta.max_seq_len == max(r_seq) and meta.block_size == runner.block_size


def _random_params(rng: random.Random) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 12), ignore_eos=True)
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.7]), top_k=rng.choice([0, 1, 5, V + 3]),
                  top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05]),
                  seed=rng.choice([None, None, 3, -7]))
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2, 5])
    return SamplingParams(**kw)


@pytest.mark.parametrize("seed", range(6))
def test_prepare_matches_reference_over_random_scheduler_runs(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    num_blocks = rng.choice([12, 24, 200]) if bs > 1 else 300
    max_model_len = min(48, (num_blocks - 1) * bs)
    mgr = KVCacheManager(num_blocks, bs, enable_caching=rng.random() < 0.7, hash_seed=0,
                         max_model_len=max_model_len)
    sched = Scheduler(max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                      max_model_len=max_model_len, kv_cache_manager=mgr,
                      long_prefill_token_threshold=rng.choice([0, 0, 5]), debug=True)
    runner = _runner(bs, num_blocks)
    shared = [rng.randrange(V) for _ in range(20)]  # common prefix -> prefix-cache hits
    next_id = 0
    finished_ids: list[str] = []
    saw = {"preempt": 0, "decode_only": 0, "mixed": 0, "reuse": 0}
    for _ in range(120):
        if rng.random() < 0.35:
            if finished_ids and rng.random() < 0.3:
                rid = finished_ids.pop(rng.randrange(len(finished_ids)))  # id reuse after finish
                saw["reuse"] += 1
            else:
                rid, next_id = f"r{next_id}", next_id + 1
            n = rng.randint(1, 30)
            prompt = (shared[:rng.randint(0, 20)] + [rng.randrange(V) for _ in range(n)])[:max_model_len - 2] or [1]
            sched.add_request(Request(rid, prompt, _random_params(rng), eos_token_id=None))
        so = sched.schedule()
        saw["preempt"] += bool(so.preempted_req_ids)
        if so.scheduled:
            if all(r.num_tokens == 1 for r in so.scheduled):
                saw["decode_only"] += 1
            else:
                saw["mixed"] += 1
        _assert_prepare_matches(runner, so)
        ro = ModelRunnerOutput()
        for r in so.scheduled:
            if r.is_last_chunk:
                ro.sampled_token_ids[r.req_id] = [rng.randrange(V)]
        for o in sched.update_from_output(so, ro):
            if o.finish_reason is not None:
                finished_ids.append(o.req_id)
        if sched.running and rng.random() < 0.08:
            victim = rng.choice(sched.running).request_id
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            finished_ids.append(victim)
        # Live rows are exactly the requests the runner saw and that are still running.
        assert set(runner.input_batch.row_of) <= set(sched.requests) | sched.finished_req_ids
    assert saw["decode_only"] and saw["mixed"], saw


def test_prepare_preemption_and_readmission_rewrite_the_row():
    """Tight KV cache: requests are preempted and re-admitted with different blocks."""
    bs = 2
    mgr = KVCacheManager(9, bs, enable_caching=False, max_model_len=16)
    sched = Scheduler(4, 32, 16, mgr, debug=True)
    runner = _runner(bs, 9)
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(1 + i, 6 + i)), SamplingParams(max_tokens=9, ignore_eos=True,
                                                                                 temperature=0.0)))
    preemptions = 0
    for _ in range(80):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        preemptions += len(so.preempted_req_ids)
        _assert_prepare_matches(runner, so)
        ro = ModelRunnerOutput()
        for r in so.scheduled:
            if r.is_last_chunk:
                ro.sampled_token_ids[r.req_id] = [7]
        sched.update_from_output(so, ro)
    assert preemptions > 0
    assert not sched.has_unfinished_requests()


def test_input_batch_rows_grow_reuse_and_reset():
    b = InputBatch(V, max_rows=2, max_blocks=2)
    sp = SamplingParams(temperature=0.0)

    def sr(rid, blocks, new=False):
        return ScheduledRequest(req_id=rid, token_ids=[1], start_pos=0, num_tokens=1, block_ids=blocks,
                                is_last_chunk=True, sampling_params=sp, prompt_len=1, is_new=new)

    rows, width = b.update([sr("a", [3]), sr("b", [4, 5, 6]), sr("c", list(range(10, 19)))], lambda r: None)
    assert width == 9 and b.num_live == 3
    assert b.block_tables(rows, 9).tolist() == [[3] + [0] * 8, [4, 5, 6] + [0] * 6, list(range(10, 19))]
    rows, width = b.update([sr("b", [4, 5, 6, 7]), sr("a", [3, 8])], lambda r: None)
    assert b.block_tables(rows, width).tolist() == [[4, 5, 6, 7], [3, 8, 0, 0]]
    # A freed row comes back zeroed for the next request.
    row_c = b.row_of["c"]
    b.remove("c")
    b.remove("unknown")
    rows, width = b.update([sr("d", [2])], lambda r: None)
    assert rows.tolist() == [row_c] and b.block_tables(rows, 9).tolist() == [[2] + [0] * 8]
    # is_new re-initialises an existing row (re-admission with a different table).
    rows, width = b.update([sr("b", [9], new=True)], lambda r: None)
    assert b.block_tables(rows, 4).tolist() == [[9, 0, 0, 0]]
    # A shorter table without is_new (not from the Scheduler) is rewritten, not mixed.
    rows, width = b.update([sr("a", [11])], lambda r: None)
    assert b.block_tables(rows, 2).tolist() == [[11, 0]]


def test_decodes_first_is_stable_and_returns_sorted_input_as_is():
    def sr(rid, n):
        return ScheduledRequest(req_id=rid, token_ids=[0] * 9, start_pos=0, num_tokens=n, block_ids=[1],
                                is_last_chunk=True)

    ordered = [sr("a", 1), sr("b", 1), sr("c", 4), sr("d", 2)]
    assert _decodes_first(ordered) is ordered
    mixed = [sr("c", 4), sr("a", 1), sr("d", 2), sr("b", 1)]
    assert [r.req_id for r in _decodes_first(mixed)] == ["a", "b", "c", "d"]


# ------------------------------------------------------------------ sampling metadata
def _assert_meta_equal(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), f.name
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), f.name
        elif f.name == "generators":
            assert x.keys() == y.keys() and all(x[k] is y[k] for k in x), f.name
        else:
            assert x == y, (f.name, x, y)


@pytest.mark.parametrize("seed", range(8))
def test_sampling_metadata_fast_path_equals_from_requests(seed):
    rng = random.Random(seed)
    b = InputBatch(V, max_rows=2)
    params, gens, rows = [], [], []
    for i in range(rng.randint(1, 40)):
        sp = _random_params(rng)
        if rng.random() < 0.3:
            sp = SamplingParams(temperature=rng.choice([0.0, 1e-6, 0.8]), top_p=rng.choice([1.0, 0.999999999]),
                                min_p=rng.choice([0.0, 1e-50]), top_k=rng.choice([0, V - 1, V]))
        g = torch.Generator().manual_seed(i) if sp.seed is not None else None
        rows.append(b.add(f"r{i}", sp, g))
        params.append(sp)
        gens.append(g)
    order = list(range(len(rows)))
    rng.shuffle(order)
    sel = order[:rng.randint(1, len(order))]
    fast = b.sampling_metadata(np.array([rows[i] for i in sel], dtype=np.int64))
    ref = SamplingMetadata.from_requests([params[i] for i in sel], [[] for _ in sel], [[] for _ in sel],
                                         [gens[i] for i in sel], V, [None] * len(sel))
    _assert_meta_equal(fast, ref)


@pytest.mark.parametrize("kw", [dict(presence_penalty=0.5), dict(frequency_penalty=-0.3),
                                dict(repetition_penalty=1.2), dict(min_tokens=2),
                                dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2])])
def test_sampling_metadata_declines_rows_that_need_the_per_row_path(kw):
    b = InputBatch(V)
    plain = SamplingParams(temperature=0.0)
    other = SamplingParams(temperature=0.7, **kw)
    assert is_simple_sampling(plain) and not is_simple_sampling(other)
    r0, r1 = b.add("a", plain), b.add("b", other)
    assert b.sampling_metadata(np.array([r0, r1])) is None
    assert b.sampling_metadata(np.array([r0])) is not None


@pytest.mark.parametrize("seed", range(4))
def test_execute_same_tokens_and_logprobs_through_either_metadata_path(seed, monkeypatch):
    """Two runners fed the same steps; one always builds metadata with from_requests."""
    rng = random.Random(seed)
    bs = 4
    fast, slow = _runner(bs, 256, seed), _runner(bs, 256, seed)
    monkeypatch.setattr(slow.input_batch, "sampling_metadata", lambda rows, device="cpu": None)
    reqs: dict[str, tuple[list[int], SamplingParams, int]] = {}
    outs_fast, outs_slow = [], []
    live: dict[str, int] = {}  # req_id -> computed tokens
    next_block = 1
    blocks: dict[str, list[int]] = {}
    for step in range(30):
        so = SchedulerOutput()
        if rng.random() < 0.5 or not live:
            rid = f"r{step}"
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 9))]
            reqs[rid] = (prompt, _random_params(rng), len(prompt))
            live[rid] = 0
        for rid in list(live):
            toks, sp, plen = reqs[rid]
            start = live[rid]
            n = len(toks) - start
            need = -(-(start + n) // bs)
            bl = blocks.setdefault(rid, [])
            while len(bl) < need:
                bl.append(next_block)
                next_block += 1
            so.scheduled.append(ScheduledRequest(req_id=rid, token_ids=toks, start_pos=start, num_tokens=n,
                                                 block_ids=list(bl), is_last_chunk=True, sampling_params=sp,
                                                 prompt_len=plen, is_new=start == 0))
            live[rid] = start + n
        torch.manual_seed(step)  # unseeded random rows draw from the global generator
        a = fast.execute(so)
        torch.manual_seed(step)
        b = slow.execute(so)
        assert a.sampled_token_ids == b.sampled_token_ids
        assert a.logprobs == b.logprobs
        outs_fast.append(a)
        outs_slow.append(b)
        for rid, (t,) in a.sampled_token_ids.items():
            reqs[rid][0].append(t)
        if live and rng.random() < 0.3:
            done = rng.choice(list(live))
            del live[done]
            so_fin = SchedulerOutput(finished_req_ids={done})
            fast.execute(so_fin)
            slow.execute(so_fin)
    assert any(o.logprobs for o in outs_fast)
