"""Speculative decoding counters kept by the scheduler (pure Python, no torch).

Names follow vLLM's ``vllm:spec_decode_*`` metrics: a *draft* is one request's set of draft
tokens verified in one step.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Monotonic totals since start (metrics take deltas).

    Attributes:
        num_spec_tokens: drafts per step configured (``k``; the length of the per-position list).
        num_drafts: verified drafts (request-steps that had at least one draft token).
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: accepted drafts at position ``j`` (0-based), ``k`` entries.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.num_accepted_tokens_per_pos) < self.num_spec_tokens:
            self.num_accepted_tokens_per_pos += [0] * (self.num_spec_tokens - len(self.num_accepted_tokens_per_pos))

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one request's verification: ``num_accepted_tokens <= num_draft_tokens``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if num_accepted_tokens > len(per_pos):
            per_pos += [0] * (num_accepted_tokens - len(per_pos))
        for j in range(num_accepted_tokens):
            per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: ``1 + accepted / drafts`` (vLLM's definition;
        1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
