"""Adaptive compute threads (pagedllm/worker/cpu_threads.py): the decisions on scripted CPU
readings, and the reading of a real busy neighbour process from /proc/stat."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pagedllm.worker import cpu_threads
from pagedllm.worker.cpu_threads import AdaptiveThreads, make_thread_controller, thread_policy


class Machine:
    """A scripted machine: ``advance(dt, ours, others)`` spends ``dt`` wall seconds during which
    this process used ``ours`` cores and other processes ``others`` cores."""

    def __init__(self) -> None:
        self.t = 100.0
        self.busy = 5000.0
        self.own = 40.0
        self.calls: list[int] = []

    def advance(self, dt: float, ours: float, others: float) -> None:
        self.t += dt
        self.own += ours * dt
        self.busy += (ours + others) * dt

    def controller(self, max_threads: int = 2, cores: int = 2, **kw) -> AdaptiveThreads:
        return AdaptiveThreads(max_threads, cores=cores, set_threads=self.calls.append,
                               read_busy=lambda: self.busy, read_self=lambda: self.own,
                               clock=lambda: self.t, **kw)


def test_quiet_machine_keeps_every_thread():
    m = Machine()
    ctl = m.controller()
    for _ in range(20):
        m.advance(0.25, ours=2.0, others=0.05)
        assert ctl.step() == 2
    assert m.calls == [] and ctl.other_cores == pytest.approx(0.05)


def test_busy_neighbour_takes_a_thread_and_gives_it_back():
    m = Machine()
    ctl = m.controller(up_after=2)
    m.advance(0.25, ours=1.33, others=0.67)  # CFS shares 2 cores between 3 spinning threads
    assert ctl.step() == 1 and m.calls == [1]
    m.advance(0.25, ours=1.0, others=1.0)  # with one thread, the neighbour gets its whole core
    assert ctl.step() == 1 and m.calls == [1]
    m.advance(0.25, ours=1.0, others=0.0)  # the neighbour stopped: one quiet reading is not enough
    assert ctl.step() == 1
    m.advance(0.25, ours=1.0, others=0.0)
    assert ctl.step() == 2 and m.calls == [1, 2] and ctl.changes == 2


def test_readings_wait_for_the_interval():
    m = Machine()
    ctl = m.controller(interval_s=0.2)
    m.advance(0.05, ours=1.0, others=1.0)
    assert ctl.step() == 2  # too soon to read: nothing changes
    m.advance(0.2, ours=1.0, others=1.0)
    assert ctl.step() == 1
    assert ctl.other_cores == pytest.approx(1.0)


@pytest.mark.parametrize("other,want", [(0.0, 4), (0.3, 4), (0.7, 3), (1.0, 3), (2.2, 2), (3.9, 1), (9.0, 1)])
def test_target_counts_free_cores(other, want):
    ctl = Machine().controller(max_threads=4, cores=4)
    assert ctl.target(other) == want


def test_never_above_the_configured_count():
    m = Machine()
    ctl = m.controller(max_threads=2, cores=8)
    m.advance(0.3, ours=2.0, others=0.0)
    assert ctl.step() == 2 and m.calls == []


def test_one_thread_and_fixed_policy_build_no_controller(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_THREAD_POLICY", "fixed")
    assert thread_policy() == "fixed" and make_thread_controller(2) is None
    monkeypatch.setenv("PAGEDLLM_THREAD_POLICY", "adaptive")
    assert make_thread_controller(1) is None
    assert isinstance(make_thread_controller(2), AdaptiveThreads)
    monkeypatch.setenv("PAGEDLLM_THREAD_POLICY", "spin")
    with pytest.raises(ValueError, match=r"PAGEDLLM_THREAD_POLICY: .spin. is not a valid value \(must be one of"):
        thread_policy()
    with pytest.raises(ValueError, match="max_threads"):
        AdaptiveThreads(0)


@pytest.mark.skipif(cpu_threads.read_machine_busy_s() is None, reason="needs /proc/stat (Linux)")
def test_real_busy_neighbour_is_seen(monkeypatch):
    """A process spinning on one core reads as >= 0.5 busy cores and takes a thread away."""
    set_to: list[int] = []
    ctl = AdaptiveThreads(2, cores=2, interval_s=0.0, set_threads=set_to.append)
    neighbour = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"])
    try:
        time.sleep(1.0)  # the reading covers this process sleeping and the neighbour spinning
        assert ctl.step() == 1, ctl.other_cores
        assert ctl.other_cores >= 0.5 and set_to == [1]
    finally:
        neighbour.kill()
        neighbour.wait()
