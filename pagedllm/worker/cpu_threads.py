"""Compute threads that follow the cores this process can actually get (CPU backend).

The trap (measured, docs/performance.md "Threads"): torch's intra-op threads are an OpenMP team
whose every parallel region ends at a barrier. With as many threads as cores, one busy process
beside the engine takes a core's timeslices from one team member, and every small op of a decode
step (a few hundred per token) then waits for the descheduled thread: single-stream decode fell
to 0.3x of its quiet speed on 2 cores, and the server's TTFT to ~8x. ``OMP_WAIT_POLICY=PASSIVE``
softens it but costs a third of the quiet speed (each region then starts with a futex wake-up).

``AdaptiveThreads`` keeps the team at most as large as the cores left free: before a step, at
most every ``interval_s``, it reads how much CPU the rest of the machine used since the last
reading (``/proc/stat`` busy time minus this process's own CPU time, both over the same wall
interval) and sets ``torch.set_num_threads(min(max_threads, cores - other))``, rounding toward
fewer threads while another process holds a core and going back up (after ``up_after`` quiet
readings, hysteresis) when it stops. A quiet machine keeps every thread and OpenMP's default
spinning, so quiet speed is unchanged; the engine thread itself is always one of the team.

Policy: ``PAGEDLLM_THREAD_POLICY=adaptive`` (default) or ``fixed`` (never change the count).
Sources: proc(5) for the ``/proc/stat`` ``cpu`` line (USER_HZ ticks: user, nice, system, idle,
iowait, irq, softirq, steal, ...), times(2) via ``os.times`` for this process's CPU time.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional
from pagedllm import envs

logger = logging.getLogger("pagedllm")

POLICIES = ("adaptive", "fixed")


def thread_policy() -> str:
    """The thread policy from ``PAGEDLLM_THREAD_POLICY`` ("adaptive" when unset).

    Raises:
        ValueError: a value other than "adaptive" or "fixed".
    """
    v: str = envs.get("PAGEDLLM_THREAD_POLICY")  # a declared choice: adaptive / fixed
    return v


def read_machine_busy_s() -> Optional[float]:
    """Seconds of CPU time all processes on the machine have used since boot (the ``cpu``
    line of ``/proc/stat``: user + nice + system + irq + softirq + steal; guest time is inside
    user), or None where ``/proc/stat`` is not readable (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 8:
        return None
    v = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return busy / _ticks_per_s()


def read_self_cpu_s() -> float:
    """Seconds of CPU time this process (all its threads) has used: user + system (times(2))."""
    t = os.times()
    return t.user + t.system


def _ticks_per_s() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class AdaptiveThreads:
    """Sets the engine's compute-thread count from the CPU the rest of the machine is using.

    Args:
        max_threads: the configured thread count (``--num-threads`` or the default); never exceeded.
        cores: cores this process may use (default: its affinity mask).
        interval_s: shortest wall time between two readings (seconds).
        up_after: consecutive readings that must allow more threads before the count goes up.
        set_threads: called with the new count (default ``torch.set_num_threads``).
        read_busy / read_self / clock: the machine's busy CPU seconds, this process's CPU seconds
            and a monotonic clock in seconds (injectable for tests).

    ``other_cores`` is the last reading of how many cores the rest of the machine kept busy (a
    float, 0 when quiet). The target is ``floor(cores - other_cores + 0.35)`` clamped to
    ``1..max_threads``: a neighbour that uses more than ~0.35 of a core takes one thread away
    (on 2 cores, a neighbour spinning on one core reads as 0.6-1.0 depending on how much CPU it
    got while the team ran).
    """

    def __init__(self, max_threads: int, cores: Optional[int] = None, interval_s: float = 0.2,
                 up_after: int = 2, set_threads: Optional[Callable[[int], None]] = None,
                 read_busy: Callable[[], Optional[float]] = read_machine_busy_s,
                 read_self: Callable[[], float] = read_self_cpu_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if set_threads is None:
            import torch
            set_threads = torch.set_num_threads
        self.max_threads = max_threads
        self.cores = cores or usable_cores()
        self.interval_s, self.up_after = interval_s, up_after
        self._set, self._busy, self._self, self._clock = set_threads, read_busy, read_self, clock
        self.threads = max_threads
        self.other_cores = 0.0
        self.changes = 0
        self._up_votes = 0
        self._last: Optional[tuple[float, float, float]] = self._sample()

    def _sample(self) -> Optional[tuple[float, float, float]]:
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._self())

    def target(self, other_cores: float) -> int:
        """Threads for a machine whose other processes keep ``other_cores`` cores busy."""
        free = self.cores - max(0.0, other_cores)
        return max(1, min(self.max_threads, int(free + 0.35)))

    def step(self) -> int:
        """Re-read the machine if ``interval_s`` has passed and adjust the thread count; returns
        the count in force. Cheap when called every step (a clock read between readings)."""
        if self._last is None or self.max_threads == 1:
            return self.threads
        now = self._clock()
        t0, busy0, self0 = self._last
        dt = now - t0
        if dt < self.interval_s:
            return self.threads
        cur = self._sample()
        if cur is None:
            return self.threads
        _, busy1, self1 = cur
        self._last = cur
        # CPU the other processes used: machine busy time minus ours (tick granularity: ~10 ms
        # per reading, hence readings no shorter than interval_s)
        self.other_cores = max(0.0, ((busy1 - busy0) - (self1 - self0)) / dt)
        want = self.target(self.other_cores)
        if want < self.threads:
            self._up_votes = 0
            self._apply(want)
        elif want > self.threads:
            self._up_votes += 1
            if self._up_votes >= self.up_after:
                self._up_votes = 0
                self._apply(want)
        else:
            self._up_votes = 0
        return self.threads

    def _apply(self, n: int) -> None:
        self._set(n)
        self.changes += 1
        logger.debug("pagedllm: compute threads %d -> %d (other processes busy on %.2f cores)",
                     self.threads, n, self.other_cores)
        self.threads = n


def make_thread_controller(max_threads: int) -> Optional[AdaptiveThreads]:
    """An ``AdaptiveThreads`` for a CPU engine with ``max_threads`` threads, or None when the
    policy is "fixed", there is one thread, or ``/proc/stat`` cannot be read. Logs the policy."""
    policy = thread_policy()
    ctl = None
    if policy == "adaptive" and max_threads > 1 and read_machine_busy_s() is not None:
        ctl = AdaptiveThreads(max_threads)
    logger.info("pagedllm: %d compute thread(s), policy %s%s", max_threads, policy if ctl or policy == "fixed"
                else "fixed", " (fewer while other processes keep cores busy; PAGEDLLM_THREAD_POLICY=fixed "
                "turns it off)" if ctl else "")
    return ctl
