"""The scheduler's side of structured outputs (no torch, no grammar library): requests wait as
WAITING_FOR_FSM while their grammar compiles, matchers advance on sampled tokens, a failed
compile aborts only its request, and grammar rows are reported only for sampling chunks."""
from __future__ import annotations

from typing import Optional

from core_helpers import FakeRunner, make_req, make_sched, run_to_completion, step
from pagedllm.core.request import RequestStatus


class FakeGrammar:
    """The interface the scheduler calls (``pagedllm.structured_output.request``): a regular
    language over token ids, ``allowed`` = the sequence the grammar accepts, then it ends."""

    def __init__(self, allowed: list[int], ready: bool = True, error: Optional[str] = None):
        self.allowed = list(allowed)
        self.ready = ready
        self._error = error
        self.accepted: list[int] = []

    def is_ready(self) -> bool:
        return self.ready

    def error(self) -> Optional[str]:
        return self._error if self.ready else None

    def accept_tokens(self, tokens: list[int]) -> bool:
        for t in tokens:
            pos = len(self.accepted)
            if pos >= len(self.allowed) or self.allowed[pos] != t:
                return False
            self.accepted.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n:]

    def is_terminated(self) -> bool:
        return len(self.accepted) == len(self.allowed)


def test_waits_for_fsm_without_blocking_others():
    s = make_sched()
    g = FakeGrammar([7, 7, 7], ready=False)
    a = make_req("a", 6, max_tokens=10)
    a.structured_output_request = g
    b = make_req("b", 6, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    assert a.status == RequestStatus.WAITING_FOR_FSM and s.num_waiting_for_fsm() == 1
    runner = FakeRunner(next_token=7)
    out, _ = step(s, runner)
    assert [r.req_id for r in out.scheduled] == ["b"]  # a is skipped, b goes ahead
    assert list(s.waiting) == [a] and a.num_computed_tokens == 0
    out, _ = step(s, runner)
    assert [r.req_id for r in out.scheduled] == ["b"]
    g.ready = True
    out, outs = step(s, runner)
    assert [r.req_id for r in out.scheduled] == ["a"]
    assert a.status == RequestStatus.RUNNING
    assert out.structured_output_request_ids == {"a": 0}
    all_outs = run_to_completion(s, runner)
    # The grammar allows exactly three 7s, then ends: "stop" (not max_tokens' "length").
    assert a.output_token_ids == [7, 7, 7] and g.accepted == [7, 7, 7]
    assert all_outs["a"][-1].finish_reason == "stop"


def test_fsm_waiters_keep_fcfs_order():
    s = make_sched(max_num_seqs=8)
    gs = {k: FakeGrammar([7], ready=False) for k in "abc"}
    for k in "abc":
        r = make_req(k, 4, max_tokens=1)
        r.structured_output_request = gs[k]
        s.add_request(r)
    gs["b"].ready = True
    out, _ = step(s, FakeRunner())
    assert [r.req_id for r in out.scheduled] == ["b"]
    assert [r.request_id for r in s.waiting] == ["a", "c"]
    gs["a"].ready = gs["c"].ready = True
    out, _ = step(s, FakeRunner())
    assert [r.req_id for r in out.scheduled] == ["a", "c"]
    assert out.structured_output_request_ids == {"a": 0, "c": 1}


def test_failed_grammar_aborts_only_its_request():
    s = make_sched()
    bad = make_req("bad", 4, max_tokens=4)
    bad.structured_output_request = FakeGrammar([7], ready=True, error="structured_outputs.json: nope")
    ok = make_req("ok", 4, max_tokens=2)
    s.add_request(bad)
    s.add_request(ok)
    out, outs = step(s, FakeRunner())
    assert [r.req_id for r in out.scheduled] == ["ok"]
    by_id = {o.req_id: o for o in outs}
    assert by_id["bad"].finish_reason == "abort" and by_id["bad"].new_token_ids == []
    assert bad.status == RequestStatus.FINISHED_ABORTED
    assert "bad" not in s.requests
    run_to_completion(s, FakeRunner())
    assert ok.output_token_ids == [7, 7]
    assert s.kv_cache_manager.num_free_blocks == 63


def test_failed_grammar_reported_by_an_empty_step():
    s = make_sched()
    bad = make_req("bad", 4)
    bad.structured_output_request = FakeGrammar([7], error="boom")
    s.add_request(bad)
    out = s.schedule()
    assert out.is_empty
    outs = s.update_from_output(out, FakeRunner().execute(out))
    assert [(o.req_id, o.finish_reason) for o in outs] == [("bad", "abort")]
    assert not s.has_unfinished_requests()


def test_token_the_grammar_refuses_aborts():
    s = make_sched()
    r = make_req("r", 4, max_tokens=5)
    r.structured_output_request = FakeGrammar([1, 2, 3])
    s.add_request(r)
    outs = run_to_completion(s, FakeRunner(tokens={"r": [1, 9]}))
    assert r.output_token_ids == [1, 9]
    assert outs["r"][-1].finish_reason == "abort"


def test_grammar_rows_only_for_sampling_chunks_and_kept_over_preemption():
    # Chunked prefill: only the last chunk samples, so only it gets a bitmask row.
    s = make_sched(max_num_batched_tokens=8, max_model_len=64)
    r = make_req("r", 20, max_tokens=3)
    g = FakeGrammar([5, 6, 7])
    r.structured_output_request = g
    s.add_request(r)
    runner = FakeRunner(tokens={"r": [5, 6, 7]})
    rows = []
    for _ in range(3):
        out, _ = step(s, runner)
        rows.append(dict(out.structured_output_request_ids))
    assert rows == [{}, {}, {"r": 0}]  # chunks of 8, 8, then the last 4 samples
    # Preempted (blocks freed, recomputed later): the matcher keeps the accepted tokens.
    s._preempt(s.running.pop())
    assert g.accepted == [5]
    run_to_completion(s, runner)
    assert r.output_token_ids == [5, 6, 7] and g.accepted == [5, 6, 7]


def test_abort_while_waiting_for_fsm():
    s = make_sched()
    r = make_req("r", 4)
    r.structured_output_request = FakeGrammar([7], ready=False)
    s.add_request(r)
    step(s, FakeRunner())
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.num_waiting_for_fsm() == 0
    assert s.schedule().finished_req_ids == {"r"}
