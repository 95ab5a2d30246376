"""Per-step engine statistics handed to stat loggers (mirrors ``vllm.v1.metrics.stats``).

The engine, after each step, builds one ``SchedulerStats`` (a snapshot) and one
``IterationStats`` (what happened in this step) and calls
``logger.record(scheduler_stats, iteration_stats)`` on each of its stat loggers.

Per-request timing is tracked with ``RequestStateStats``: create one when a request arrives,
call ``observe(...)`` each step the request produced tokens (or finished); it appends TTFT /
inter-token latencies / finished-request records to that step's ``IterationStats``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SchedulerStats:
    """Scheduler snapshot after one engine step.

    Attributes:
        num_running_reqs: requests in the running queue.
        num_waiting_reqs: requests waiting to be scheduled (incl. preempted).
        kv_cache_usage: fraction of KV cache blocks in use (0..1).
        prefix_cache_queries: prompt tokens looked up in the prefix cache during this step
            (a delta, not a running total).
        prefix_cache_hits: of those, tokens found in the cache (delta).
        structured_output_cache_queries / structured_output_cache_hits: grammar-cache lookups
            by constrained requests, and of those the hits (deltas).
        structured_output_compile_failures: constraints no backend could compile (delta).
        structured_output_cache_entries: compiled grammars held (snapshot; bounded by
            ``structured_output_cache_capacity``).
        spec_decode_num_drafts / spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens:
            speculative decoding this step: verified drafts (request-steps), draft tokens, and
            accepted ones (deltas).
        spec_decode_num_accepted_tokens_per_pos: accepted drafts per draft position (deltas).
        spec_decode_suffix_cached_requests / spec_decode_suffix_cache_capacity /
        spec_decode_suffix_tree_nodes: the suffix proposer's global cache (snapshots).
        spec_decode_method: the speculative method ("ngram", "mtp", ...; "" when off).
        jump_forward_num_drafts / jump_forward_num_draft_tokens / jump_forward_num_accepted_tokens:
            jump-forward structured decoding this step: verified grammar drafts (request-steps),
            their tokens, and the accepted ones (deltas).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    structured_output_cache_queries: int = 0
    structured_output_cache_hits: int = 0
    structured_output_compile_failures: int = 0
    structured_output_cache_entries: int = 0
    structured_output_cache_capacity: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_decode_suffix_cached_requests: int = 0
    spec_decode_suffix_cache_capacity: int = 0
    spec_decode_suffix_tree_nodes: int = 0
    spec_decode_method: str = ""
    jump_forward_num_drafts: int = 0
    jump_forward_num_draft_tokens: int = 0
    jump_forward_num_accepted_tokens: int = 0

    @classmethod
    def from_totals(cls, stats: dict, prev: Optional[dict] = None) -> "SchedulerStats":
        """Build from ``AsyncLLM.get_scheduler_stats()``-style totals (deltas vs ``prev``)."""
        prev = prev or {}
        return cls(
            num_running_reqs=int(stats.get("num_running", stats.get("num_running_reqs", 0))),
            num_waiting_reqs=int(stats.get("num_waiting", stats.get("num_waiting_reqs", 0))),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
            prefix_cache_queries=_delta(stats, prev, "prefix_cache_queries"),
            prefix_cache_hits=_delta(stats, prev, "prefix_cache_hits"),
            structured_output_cache_queries=_delta(stats, prev, "structured_output_cache_queries"),
            structured_output_cache_hits=_delta(stats, prev, "structured_output_cache_hits"),
            structured_output_compile_failures=_delta(stats, prev, "structured_output_compile_failures"),
            structured_output_cache_entries=int(stats.get("structured_output_cache_entries", 0)),
            structured_output_cache_capacity=int(stats.get("structured_output_cache_capacity", 0)),
            spec_decode_num_drafts=_delta(stats, prev, "spec_decode_num_drafts"),
            spec_decode_num_draft_tokens=_delta(stats, prev, "spec_decode_num_draft_tokens"),
            spec_decode_num_accepted_tokens=_delta(stats, prev, "spec_decode_num_accepted_tokens"),
            spec_decode_num_accepted_tokens_per_pos=_delta_list(
                stats.get("spec_decode_num_accepted_tokens_per_pos") or [],
                prev.get("spec_decode_num_accepted_tokens_per_pos") or []),
            spec_decode_suffix_cached_requests=int(stats.get("spec_decode_suffix_cached_requests", 0)),
            spec_decode_suffix_cache_capacity=int(stats.get("spec_decode_suffix_cache_capacity", 0)),
            spec_decode_suffix_tree_nodes=int(stats.get("spec_decode_suffix_tree_nodes", 0)),
            spec_decode_method=str(stats.get("spec_decode_method") or ""),
            jump_forward_num_drafts=_delta(stats, prev, "jump_forward_num_drafts"),
            jump_forward_num_draft_tokens=_delta(stats, prev, "jump_forward_num_draft_tokens"),
            jump_forward_num_accepted_tokens=_delta(stats, prev, "jump_forward_num_accepted_tokens"),
        )


def _delta_list(cur: list, prev: list) -> list[int]:
    """Element-wise delta of two monotonic count lists (a shorter ``prev`` counts as zeros)."""
    out = []
    for i, c in enumerate(cur):
        p = prev[i] if i < len(prev) else 0
        out.append(c - p if c >= p else c)
    return out


def _delta(cur: dict, prev: dict, key: str) -> int:
    c = int(cur.get(key, 0) or 0)
    p = int(prev.get(key, 0) or 0)
    return c - p if c >= p else c  # a total that went down was reset: count it from zero


class SchedulerStatsAdapter:
    """Accepts either a ``SchedulerStats`` or the engine's totals dict
    (``get_scheduler_stats()``: num_running, num_waiting, kv_cache_usage,
    num_preemptions_total, prefix_cache_queries, prefix_cache_hits) and returns
    ``(SchedulerStats, preemptions_delta_or_None)``."""

    def __init__(self) -> None:
        self.prev: dict = {}

    def __call__(self, stats) -> tuple[Optional["SchedulerStats"], Optional[int]]:
        if stats is None or isinstance(stats, SchedulerStats):
            return stats, None
        if not isinstance(stats, dict):
            stats = dict(vars(stats))
        out = SchedulerStats.from_totals(stats, self.prev)
        preempt = None
        if "num_preemptions_total" in stats:
            preempt = _delta(stats, self.prev, "num_preemptions_total")
        self.prev = dict(stats)
        return out, preempt


@dataclass
class FinishedRequestStats:
    """One request that finished in this step.

    Attributes:
        finish_reason: "stop", "length" or "abort".
        e2e_latency: seconds from arrival to finish.
        queue_time: seconds from arrival to first being scheduled.
        num_prompt_tokens / num_generation_tokens: token counts of the request (all samples).
        prefill_time: seconds from first being scheduled to the first output token.
        decode_time: seconds from the first output token to finish.
        inference_time: seconds from first being scheduled to finish (prefill + decode).
    """

    finish_reason: str
    e2e_latency: float = 0.0
    queue_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0


@dataclass
class IterationStats:
    """What happened in one engine step.

    Attributes:
        iteration_timestamp: when the step finished (time.time()).
        num_prompt_tokens: prompt tokens of requests whose prefill completed in this step.
        num_generation_tokens: tokens generated in this step (all requests, all samples).
        time_to_first_tokens_iter: TTFT (s) of requests that got their first token this step.
        inter_token_latencies_iter: time (s) since the previous token, per request that got a
            non-first token this step.
        finished_requests: requests that finished in this step.
        num_preempted: requests preempted in this step.
        grammar_compile_seconds: durations of the structured-output grammar compiles that
            finished since the previous step.
    """

    iteration_timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    num_preempted: int = 0
    grammar_compile_seconds: list[float] = field(default_factory=list)


@dataclass
class RequestStateStats:
    """Timing state of one request, for filling ``IterationStats``.

    Times are seconds from one clock (``time.time()`` or ``time.monotonic()``, as long as the
    same clock is used for arrival_time, first_scheduled_time and now).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished: bool = False

    def observe(
        self,
        iteration_stats: IterationStats,
        arrival_time: float,
        first_scheduled_time: Optional[float],
        now: float,
        num_new_tokens: int,
        is_first_token: bool,
        finished_reason: Optional[str] = None,
        num_prompt_tokens: Optional[int] = None,
    ) -> None:
        """Record this step's progress of the request into ``iteration_stats``.

        Args:
            arrival_time: when the request arrived.
            first_scheduled_time: when it was first scheduled (None if never, e.g. aborted
                while waiting).
            now: the current time.
            num_new_tokens: tokens generated for it in this step (0 allowed, e.g. on abort).
            is_first_token: this step produced its first output token (prefill completed).
            finished_reason: "stop"/"length"/"abort" if it finished in this step, else None.
            num_prompt_tokens: prompt length (stored on first use).
        """
        if self.finished:
            return
        if num_prompt_tokens is not None:
            self.num_prompt_tokens = int(num_prompt_tokens)
        if num_new_tokens > 0:
            if is_first_token or self.first_token_time is None:
                iteration_stats.num_prompt_tokens += self.num_prompt_tokens
                iteration_stats.time_to_first_tokens_iter.append(max(0.0, now - arrival_time))
                self.first_token_time = now
            elif self.last_token_time is not None:
                iteration_stats.inter_token_latencies_iter.append(max(0.0, now - self.last_token_time))
            self.last_token_time = now
            self.num_generation_tokens += int(num_new_tokens)
            iteration_stats.num_generation_tokens += int(num_new_tokens)
        if finished_reason is not None:
            self.finished = True
            sched = first_scheduled_time if first_scheduled_time is not None else now
            first = self.first_token_time if self.first_token_time is not None else now
            iteration_stats.finished_requests.append(FinishedRequestStats(
                finish_reason=str(finished_reason),
                e2e_latency=max(0.0, now - arrival_time),
                queue_time=max(0.0, sched - arrival_time),
                num_prompt_tokens=self.num_prompt_tokens,
                num_generation_tokens=self.num_generation_tokens,
                prefill_time=max(0.0, first - sched),
                decode_time=max(0.0, now - first),
                inference_time=max(0.0, now - sched),
            ))
