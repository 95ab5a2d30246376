"""Routing policies (pure functions, no I/O, no torch): which replica gets a request.

* ``round-robin``: the next eligible replica in turn.
* ``least-load``: fewest requests in flight (dispatched by the router, not finished); ties go
  round-robin.
* ``sticky``: the same session key (the ``X-Session-Id`` header, else the body's ``user``) goes to
  the same replica while it is eligible (rendezvous hashing, so a replica leaving moves only its
  own sessions); no key: least-load.
* ``prefix``: when the longest prefix of the prompt any eligible replica holds
  (``PrefixIndex.match``) covers more than ``cache_threshold`` of the prompt's blocks and the load
  is balanced, i.e. NOT (max - min in flight > ``balance_abs_threshold`` and max >
  ``balance_rel_threshold`` * min), the replica with the lowest cost
  ``(1 - matched_blocks / prompt_blocks) + load_weight * in_flight`` (the share of the prompt it
  must compute, plus its load), ties by load; otherwise least-load (SGLang's ``sgl-router`` cache-
  aware policy has the two thresholds and the fallback). The load term is what keeps a prefix every
  conversation shares (a system prompt) from sending every new conversation to the one replica
  that cached it first: once that replica has ``(its advantage) / load_weight`` more requests in
  flight, the next goes elsewhere, and from then on both hold it.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Optional, Sequence

POLICIES = ("prefix", "least-load", "round-robin", "sticky")
#: ``PolicyConfig.tie_break`` values.
TIE_BREAKS = ("turn", "first", "random")


@dataclass
class PolicyConfig:
    """Knobs of the prefix policy (see the module docstring)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    load_weight: float = 0.1
    #: how ``least-load`` (and the prefix policy's equal costs) break ties of equal load: ``"turn"``
    #: (in turn, the default), ``"first"`` (the lowest index: sgl-router's ``min_by_key``,
    #: vLLM production-stack's lowest-QPS loop) or ``"random"`` (the Gateway API Inference
    #: Extension's max-score picker, which llm-d's scheduler uses: shuffle, then a stable sort;
    #: seeded by ``tie_seed``).
    tie_break: str = "turn"
    tie_seed: int = 0


@dataclass
class Decision:
    """The chosen replica index, why (``"prefix"``, ``"load"``, ``"round-robin"``, ``"sticky"``)
    and the prompt blocks it already holds."""

    replica: int
    reason: str
    matched_blocks: int = 0


class Router:
    """Chooses among replicas ``0..n-1``.

    Args:
        policy: one of ``POLICIES``.
        config: prefix-policy knobs.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, policy: str, config: Optional[PolicyConfig] = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {list(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.config = config or PolicyConfig()
        if self.config.tie_break not in TIE_BREAKS:
            raise ValueError(f"tie_break: expected one of {list(TIE_BREAKS)}, got {self.config.tie_break!r}")
        self._rr = 0
        self._rng = random.Random(self.config.tie_seed)

    def _least_load(self, eligible: Sequence[int], in_flight: Sequence[int]) -> int:
        low = min(in_flight[i] for i in eligible)
        ties = [i for i in eligible if in_flight[i] == low]
        tb = self.config.tie_break
        if tb == "first":
            return ties[0]
        if tb == "random":
            return ties[self._rng.randrange(len(ties))] if len(ties) > 1 else ties[0]
        pick = ties[self._rr % len(ties)]
        self._rr += 1
        return pick

    def choose(self, eligible: Sequence[int], in_flight: Sequence[int], *,
               matches: Optional[dict[int, int]] = None, prompt_blocks: int = 0,
               session: Optional[str] = None) -> Decision:
        """Pick one of ``eligible`` (replica indices, non-empty).

        Args:
            eligible: healthy, not draining replicas.
            in_flight: requests in flight per replica (indexed by replica).
            matches: replica -> leading prompt blocks it holds (prefix policy).
            prompt_blocks: full blocks in the prompt (prefix policy).
            session: the session key (sticky policy).

        Raises:
            ValueError: no eligible replica.
        """
        if not eligible:
            raise ValueError("no eligible replica")
        if self.policy == "round-robin":
            pick = eligible[self._rr % len(eligible)]
            self._rr += 1
            return Decision(pick, "round-robin")
        if self.policy == "sticky" and session:
            best = max(eligible, key=lambda i: hashlib.blake2b(f"{session}|{i}".encode(), digest_size=8).digest())
            return Decision(best, "sticky")
        if self.policy == "prefix" and matches and prompt_blocks > 0:
            c = self.config
            loads = [in_flight[i] for i in eligible]
            hi, lo = max(loads), min(loads)
            imbalanced = hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo
            cands = {i: d for i, d in matches.items() if i in eligible}
            if cands and not imbalanced:
                depth = max(cands.values())
                if depth / prompt_blocks > c.cache_threshold:
                    cost = {i: (1.0 - cands.get(i, 0) / prompt_blocks) + c.load_weight * in_flight[i]
                            for i in eligible}
                    low = min(cost.values())
                    best = [i for i in eligible if cost[i] <= low + 1e-9]
                    pick = self._least_load(best, in_flight)
                    got = cands.get(pick, 0)
                    return Decision(pick, "prefix" if got == depth else "load", got)
        pick = self._least_load(eligible, in_flight)
        return Decision(pick, "load", (matches or {}).get(pick, 0))
