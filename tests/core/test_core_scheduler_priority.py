"""Priority scheduling (vLLM's --scheduling-policy priority): waiting order by (priority, arrival),
the preemption victim is the lowest-priority (largest value, latest arrival) running request, and a
preempted request re-enters the waiting queue at its place in that order."""
import pytest

from core_helpers import FakeRunner, make_req, make_sched, run_to_completion, step
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler


def _req(rid, n, prio, t, max_tokens=1):
    r = make_req(rid, n, max_tokens=max_tokens)
    r.priority, r.arrival_time = prio, t
    return r


def _admission_order(runner):
    seen = []
    for out in runner.history:
        for s in out.scheduled:
            if s.is_new and s.req_id not in seen:
                seen.append(s.req_id)
    return seen


@pytest.mark.parametrize("policy,expected", [
    ("priority", ["b", "e", "d", "c", "a"]),  # (0, 2.0) b then e (same key: insertion order), (0, 4.0) d, ...
    ("fcfs", ["a", "b", "c", "d", "e"]),      # priorities ignored: arrival (insertion) order
])
def test_waiting_order(policy, expected):
    s = make_sched(max_num_seqs=1, policy=policy)
    for rid, prio, t in (("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 0, 4.0), ("e", 0, 2.0)):
        s.add_request(_req(rid, 5, prio, t))
    if policy == "priority":
        assert [r.request_id for r in s.waiting] == expected
    runner = FakeRunner()
    run_to_completion(s, runner)
    assert _admission_order(runner) == expected


def test_late_high_priority_request_overtakes_the_queue():
    """One slot: a request added while others wait runs next when its priority value is lowest."""
    s = make_sched(max_num_seqs=1, policy="priority")
    for i in range(3):
        s.add_request(_req(f"low{i}", 5, 1, float(i), max_tokens=3))
    runner = FakeRunner()
    step(s, runner)  # low0 admitted
    s.add_request(_req("urgent", 5, -1, 10.0, max_tokens=3))
    assert [r.request_id for r in s.waiting] == ["urgent", "low1", "low2"]
    run_to_completion(s, runner)
    assert _admission_order(runner) == ["low0", "urgent", "low1", "low2"]


def test_preemption_victim_is_lowest_priority_not_newest():
    # 6 usable blocks; three 8-token prompts (2 blocks each) fill the pool.
    s = make_sched(num_blocks=7, block_size=4, max_model_len=24, enable_caching=False, policy="priority")
    r0, r1, r2 = _req("r0", 8, 0, 1.0, 10), _req("r1", 8, 2, 2.0, 10), _req("r2", 8, 1, 3.0, 10)
    for r in (r0, r1, r2):
        s.add_request(r)
    runner = FakeRunner()
    step(s, runner)
    out, _ = step(s, runner)  # r0 needs a 3rd block: r1 (priority 2) goes, not r2 (the newest)
    assert out.preempted_req_ids == {"r1"}
    assert [x.req_id for x in out.scheduled] == ["r0", "r2"]
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    # A later request of priority 1 queues ahead of the preempted priority-2 one.
    s.add_request(_req("r3", 4, 1, 4.0, 2))
    assert [r.request_id for r in s.waiting] == ["r3", "r1"]
    run_to_completion(s, runner)
    assert all(r.num_output_tokens == 10 for r in (r0, r1, r2))


def test_fcfs_preempts_the_newest_whatever_its_priority():
    s = make_sched(num_blocks=7, block_size=4, max_model_len=24, enable_caching=False, policy="fcfs")
    reqs = [_req("r0", 8, 0, 1.0, 10), _req("r1", 8, 2, 2.0, 10), _req("r2", 8, 1, 3.0, 10)]
    for r in reqs:
        s.add_request(r)
    runner = FakeRunner()
    step(s, runner)
    out, _ = step(s, runner)
    assert out.preempted_req_ids == {"r2"}


def test_victim_already_scheduled_this_step_gives_its_tokens_back():
    """Running [a (priority 5, admitted first), b (priority 0)]: a's decode fits, then b needs a
    block; the victim is a, already in this step's batch: it leaves the batch (its token budget
    returned) and b runs."""
    s = make_sched(num_blocks=5, block_size=4, max_model_len=16, enable_caching=False, policy="priority")
    a, b = _req("a", 5, 5, 1.0, 4), _req("b", 8, 0, 2.0, 4)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner()
    step(s, runner)  # both prefilled: 4 blocks in use
    out, _ = step(s, runner)
    assert out.preempted_req_ids == {"a"}
    assert [x.req_id for x in out.scheduled] == ["b"]
    assert out.total_num_scheduled_tokens == 1
    assert a.status == RequestStatus.PREEMPTED and a.output_token_ids == [7]
    run_to_completion(s, runner)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4


def test_request_that_is_the_victim_lets_the_rest_run():
    """The request that needs a block is itself the lowest priority: it is preempted and the
    running requests after it are still scheduled this step (fcfs would stop there)."""
    s = make_sched(num_blocks=5, block_size=4, max_model_len=16, enable_caching=False, policy="priority")
    a, b = _req("a", 7, 5, 1.0, 4), _req("b", 7, 0, 2.0, 4)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner()
    step(s, runner)
    step(s, runner)  # both decode into their 2nd block
    out, _ = step(s, runner)  # a needs a 3rd block and is the victim; b gets one of its blocks
    assert out.preempted_req_ids == {"a"}
    assert [x.req_id for x in out.scheduled] == ["b"]
    run_to_completion(s, runner)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4


def test_unknown_policy():
    from pagedllm.core.kv_cache_manager import KVCacheManager
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(4, 64, 64, KVCacheManager(16, 4), policy="lifo")
