"""The simulator's fast-forward (runs of pure-decode steps applied without calling the scheduler)
gives what stepping one scheduler call at a time gives: the same steps per replica, the same time
of every emitted token, the same hit rates and summary, for every policy, open and closed loop,
with evictions and preemptions."""
from __future__ import annotations

import pytest

from pagedllm.router.policy import PolicyConfig
from pagedllm.sim.simulator import ReplicaConfig, simulate
from pagedllm.sim.step_model import StepModel
from pagedllm.sim.trace import synthetic_trace

MODEL = StepModel(a=0.01, b_prefill_token=2e-4, c_decode_row=2e-3, d_decode_context_ktoken=1e-3,
                  e_prefill_attention_kpair=1e-5)


def _strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "wall_s"}


def _per_replica(steps: list) -> list:
    return sorted(steps, key=lambda s: (s[0], s[1]))


CASES = [
    # kind, policy, blocks, closed loop, the router's rules
    ("multi-turn", "least-load", 1024, False, False),
    ("multi-turn", "prefix", 300, False, False),
    ("multi-turn", "sticky", 600, True, False),
    ("multi-turn", "prefix", 600, True, True),
    ("multi-turn", "least-load", 600, True, True),
    ("poisson", "round-robin", 1024, False, False),
    ("bursty", "prefix", 600, False, False),
    ("long-doc", "least-load", 1024, False, False),  # preemptions
    ("long-doc", "sticky", 300, False, False),  # evictions and preemptions
]


@pytest.mark.parametrize("kind,policy,blocks,closed,rules", CASES)
def test_fast_forward_equals_step_by_step(kind, policy, blocks, closed, rules):
    trace = synthetic_trace(kind, rate=4.0, duration_s=30, seed=3)
    cfg = ReplicaConfig(num_blocks=blocks, max_model_len=4096 if blocks < 1000 else 8192, max_num_seqs=16)
    kw = dict(seed=1, record_steps=True, record_token_times=True, closed_loop=closed,
              router_rules=PolicyConfig() if rules else None)
    slow = simulate(trace, 3, policy, MODEL, cfg, fast_forward=False, **kw)
    fast = simulate(trace, 3, policy, MODEL, cfg, fast_forward=True, **kw)
    assert slow.summary["num_completed"] > 0 and slow.summary["num_steps"] > 1000
    assert _strip(fast.summary) == _strip(slow.summary)
    assert fast.replicas == slow.replicas
    assert fast.token_times == slow.token_times  # every token of every request at the same time
    assert _per_replica(fast.steps) == _per_replica(slow.steps)
    n_tokens = sum(len(v) for v in slow.token_times.values())
    assert n_tokens == slow.summary["num_output_tokens"]
    if kind == "long-doc" and blocks == 1024:
        assert slow.summary["num_preemptions"] > 0
    # each request's scheduler state at the end: all its tokens, in the same order
    for a, b in zip(slow.replica_objects, fast.replica_objects):
        assert a.mgr.prefix_cache_stats.hits == b.mgr.prefix_cache_stats.hits
        assert a.mgr.prefix_cache_stats.queries == b.mgr.prefix_cache_stats.queries
        assert a.pool.get_usage() == b.pool.get_usage()


def test_fast_forward_skips_scheduler_calls(monkeypatch):
    """The point of it: most pure-decode steps of a lightly loaded fleet never call schedule()."""
    from pagedllm.core.scheduler import Scheduler

    calls = [0]
    orig = Scheduler.schedule

    def counting(self):
        calls[0] += 1
        return orig(self)

    monkeypatch.setattr(Scheduler, "schedule", counting)
    trace = synthetic_trace("multi-turn", rate=1.0, duration_s=60, seed=0)
    res = simulate(trace, 4, "least-load", MODEL, ReplicaConfig(num_blocks=1024))
    steps = res.summary["num_steps"]
    assert calls[0] < steps // 3, (calls[0], steps)
