"""Periodic log line with throughput and scheduler state (vLLM's LoggingStatLogger)."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Optional

from pagedllm.metrics.memory import format_bytes
from pagedllm.metrics.stats import IterationStats, SchedulerStats, SchedulerStatsAdapter

logger = logging.getLogger("pagedllm.metrics")

# Number of recent prefix-cache lookups (steps) the hit rate is computed over.
_PREFIX_CACHE_WINDOW_QUERIES = 1_000_000


class LoggingStatLogger:
    """Accumulates stats from ``record`` and logs one line every ``interval`` seconds:

    "Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs,
    Waiting: M reqs, KV cache usage: P%, Prefix cache hit rate: H%[, Spec decode: mean
    acceptance length L, accepted A/D draft tokens, per position a0, a1, ...][, Resident memory:
    R, CPU allocator cache: C]" (the speculative decoding part covers the interval, when it had
    drafts).

    ``record`` logs itself once the interval has passed; ``log()`` can also be called from a
    timer (the API server does, every interval) so the line keeps coming while idle requests
    drain. Idle periods (nothing processed, nothing running or waiting) log only once.
    """

    def __init__(self, interval: float = 5.0, log_fn=None, memory_fn=None):
        self.interval = float(interval)
        # Optional callable returning get_memory_stats()-style bytes (resident memory, the CPU
        # allocator's cache) for the end of the line.
        self._memory_fn = memory_fn
        self._log_fn = log_fn or logger.info
        self._lock = threading.Lock()
        self._adapt = SchedulerStatsAdapter()
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.last_scheduler_stats = SchedulerStats()
        # (queries, hits) per step, bounded by total queries.
        self._prefix_window: deque[tuple[int, int]] = deque()
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._last_line_idle = False
        self.last_line: Optional[str] = None
        # Speculative decoding over the interval: drafts, draft tokens, accepted, per position.
        self._spec = [0, 0, 0]
        self._spec_per_pos: list[int] = []

    def record(self, scheduler_stats: Optional[SchedulerStats],
               iteration_stats: Optional[IterationStats]) -> None:
        with self._lock:
            scheduler_stats, preempt = self._adapt(scheduler_stats)
            if iteration_stats is None and preempt:
                self.num_preemptions += preempt
            if iteration_stats is not None:
                self.num_prompt_tokens += iteration_stats.num_prompt_tokens
                self.num_generation_tokens += iteration_stats.num_generation_tokens
                self.num_preemptions += iteration_stats.num_preempted
            if scheduler_stats is not None:
                self.last_scheduler_stats = scheduler_stats
                if scheduler_stats.spec_decode_num_drafts:
                    self._spec[0] += scheduler_stats.spec_decode_num_drafts
                    self._spec[1] += scheduler_stats.spec_decode_num_draft_tokens
                    self._spec[2] += scheduler_stats.spec_decode_num_accepted_tokens
                    pp = self._spec_per_pos
                    for i, n in enumerate(scheduler_stats.spec_decode_num_accepted_tokens_per_pos):
                        if i >= len(pp):
                            pp.append(0)
                        pp[i] += n
                q, h = scheduler_stats.prefix_cache_queries, scheduler_stats.prefix_cache_hits
                if q > 0:
                    self._prefix_window.append((q, h))
                    self._prefix_queries += q
                    self._prefix_hits += h
                    while self._prefix_queries > _PREFIX_CACHE_WINDOW_QUERIES and len(self._prefix_window) > 1:
                        oq, oh = self._prefix_window.popleft()
                        self._prefix_queries -= oq
                        self._prefix_hits -= oh
        self.maybe_log()

    def maybe_log(self) -> None:
        if time.monotonic() - self.last_log_time >= self.interval:
            self.log()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0

    def _memory_part(self) -> str:
        if self._memory_fn is None:
            return ""
        try:
            m = self._memory_fn()
        except Exception:  # a failed reading must not stop the log line
            return ""
        part = ""
        if m.get("resident_memory_bytes"):
            part += f", Resident memory: {format_bytes(m['resident_memory_bytes'])}"
        if m.get("kv_cache_bytes"):
            part += (f", KV cache committed: {format_bytes(m.get('kv_cache_committed_bytes', 0))}"
                     f" of {format_bytes(m['kv_cache_bytes'])}")
        if "cpu_allocator_cached_bytes" in m:
            part += f", CPU allocator cache: {format_bytes(m['cpu_allocator_cached_bytes'])}"
        return part

    def log(self) -> Optional[str]:
        with self._lock:
            now = time.monotonic()
            elapsed = max(now - self.last_log_time, 1e-9)
            prompt_tp = self.num_prompt_tokens / elapsed
            gen_tp = self.num_generation_tokens / elapsed
            s = self.last_scheduler_stats
            self.num_prompt_tokens = 0
            self.num_generation_tokens = 0
            self.last_log_time = now
            idle = (prompt_tp == 0 and gen_tp == 0 and s.num_running_reqs == 0
                    and s.num_waiting_reqs == 0)
            line = (f"Avg prompt throughput: {prompt_tp:.1f} tokens/s, "
                    f"Avg generation throughput: {gen_tp:.1f} tokens/s, "
                    f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                    f"KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
                    f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%")
            if self._spec[0]:
                drafts, drafted, accepted = self._spec
                rates = ", ".join(f"{n / drafts:.2f}" for n in self._spec_per_pos)
                line += (f", Spec decode: mean acceptance length {1 + accepted / drafts:.2f}, "
                         f"accepted {accepted}/{drafted} draft tokens, per position {rates}")
                self._spec = [0, 0, 0]
                self._spec_per_pos = []
            line += self._memory_part()
            self.last_line = line
            skip = idle and self._last_line_idle
            self._last_line_idle = idle
        if not skip:
            self._log_fn(line)
            return line
        return None
