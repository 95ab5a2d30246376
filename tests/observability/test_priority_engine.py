"""Priority scheduling end to end on a tiny random model: offline ``LLM.generate(priority=...)``
and the server's ``priority`` field (vLLM's semantics: lower runs first; with fcfs a nonzero
priority is refused, naming the field)."""
from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from obs_helpers import TINY_KW
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 3, 88, 42, 9]} for i in range(3)]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _finish_order(llm, monkeypatch) -> list[str]:
    """Spy on the engine's step: the ids of requests in the order they finished."""
    order: list[str] = []
    real = llm.llm_engine.step

    def step():
        outs = real()
        order.extend(o.request_id for o in outs if o.finished)
        return outs
    monkeypatch.setattr(llm.llm_engine, "step", step)
    return order


@pytest.fixture(scope="module")
def prio_llm(tiny_model):
    return LLM(tiny_model, max_num_seqs=1, scheduling_policy="priority", **TINY_KW)


def test_llm_generate_priority_runs_lowest_value_first(prio_llm, tiny_model, monkeypatch):
    order = _finish_order(prio_llm, monkeypatch)
    outs = prio_llm.generate(PROMPTS, SP, use_tqdm=False, priority=[1, 1, 0])
    ids = [o.request_id for o in outs]
    assert order == [ids[2], ids[0], ids[1]]  # the last prompt (priority 0) first, then in order
    # Same tokens as first-come-first-served (scheduling changes the order, not the outputs).
    fcfs = LLM(tiny_model, max_num_seqs=1, **TINY_KW)
    order_fcfs = _finish_order(fcfs, monkeypatch)
    ref = fcfs.generate(PROMPTS, SP, use_tqdm=False)
    assert order_fcfs == [o.request_id for o in ref]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    with pytest.raises(ValueError, match="priority"):
        fcfs.generate(PROMPTS[:2], SP, use_tqdm=False, priority=[0, 3])
    assert fcfs.generate(PROMPTS[:1], SP, use_tqdm=False, priority=[0])[0].finished


def test_llm_generate_priority_length_checked(prio_llm):
    with pytest.raises(ValueError, match="priority: got 2 for 3 prompts"):
        prio_llm.generate(PROMPTS, SP, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority: expected an integer"):
        prio_llm.generate(PROMPTS[:1], SP, use_tqdm=False, priority=["high"])


def test_unknown_policy_fails_before_loading(tiny_model):
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_model, scheduling_policy="lifo", **TINY_KW)


def test_server_high_priority_request_submitted_later_finishes_first(tiny_model):
    """One running slot: A runs; B (priority 5) then C (priority -1) queue behind it; C is
    admitted (and finishes) before B. Each engine step is slowed by 10 ms (a delay around the
    real executor) so that A is still running when B and C have been queued."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model, max_num_seqs=1,
                                                  scheduling_policy="priority", **TINY_KW))
    real = engine.engine.core.executor.execute_model

    def slow(*a, **k):
        time.sleep(0.01)
        return real(*a, **k)
    engine.engine.core.executor.execute_model = slow
    sched = engine.engine.core.scheduler
    finished: list[str] = []
    results: dict[str, dict] = {}
    lock = threading.Lock()
    try:
        with TestClient(build_app(engine)) as client:
            def post(name, prio, n):
                r = client.post("/v1/completions", json={
                    "prompt": [5, 17, 3, 88], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "priority": prio})
                with lock:
                    finished.append(name)
                    results[name] = r
            ta = threading.Thread(target=post, args=("A", 0, 40))
            ta.start()
            _wait(lambda: sched.num_running == 1)
            tb = threading.Thread(target=post, args=("B", 5, 4))
            tb.start()
            _wait(lambda: sched.num_waiting == 1)
            tc = threading.Thread(target=post, args=("C", -1, 4))
            tc.start()
            _wait(lambda: sched.num_waiting == 2)
            assert "A" not in finished  # B and C both queued while A runs
            assert [r.priority for r in sched.waiting] == [-1, 5]
            for t in (ta, tb, tc):
                t.join(timeout=120)
    finally:
        engine.shutdown()
    assert finished == ["A", "C", "B"]
    for name, n in (("A", 40), ("B", 4), ("C", 4)):
        assert results[name].status_code == 200, results[name].text
        assert results[name].json()["usage"]["completion_tokens"] == n


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.002)
