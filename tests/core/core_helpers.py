"""Shared helpers for core tests: a SamplingParams stand-in and a fake model runner.

No torch anywhere (core/ is pure Python).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler


@dataclass
class SP:
    """Tiny stand-in for pagedllm.sampling_params.SamplingParams (same field names)."""

    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: Optional[int] = None


@dataclass
class PP:
    """Stand-in for PoolingParams."""

    pooling_type: str = "LAST"


def make_req(req_id, prompt, max_tokens=16, eos=None, salt=None, **sp_kwargs) -> Request:
    if isinstance(prompt, int):
        # Distinct tokens per request id, so tests get no accidental prefix hits.
        base = 10_000 + (zlib.crc32(req_id.encode()) % 1000) * 1000
        prompt = list(range(base, base + prompt))
    return Request(req_id, prompt, SP(max_tokens=max_tokens, **sp_kwargs), eos_token_id=eos,
                   cache_salt=salt)


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
               max_model_len=128, enable_caching=True, hash_algo="sha256", **kw) -> Scheduler:
    mgr = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, hash_algo=hash_algo,
                         hash_seed=0, max_model_len=max_model_len)
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len, mgr, debug=True, **kw)


class FakeRunner:
    """Returns ``next_token`` (or ``tokens[req_id]`` in turn) for every request whose chunk
    reaches the end of its tokens; records what it was asked to compute."""

    def __init__(self, next_token: int = 7, tokens: Optional[dict[str, list[int]]] = None):
        self.next_token = next_token
        self.tokens = {k: list(v) for k, v in (tokens or {}).items()}
        self.history: list[SchedulerOutput] = []
        # req_id -> list of (start_pos, num_tokens)
        self.chunks: dict[str, list[tuple[int, int]]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.history.append(out)
        res = ModelRunnerOutput()
        for s in out.scheduled:
            self.chunks.setdefault(s.req_id, []).append((s.start_pos, s.num_tokens))
            if not s.is_last_chunk:
                continue
            if s.pooling_params is not None:
                res.pooler_output[s.req_id] = ("pooled", s.req_id)
                continue
            queue = self.tokens.get(s.req_id)
            tok = queue.pop(0) if queue else self.next_token
            res.sampled_token_ids[s.req_id] = [tok]
            res.logprobs[s.req_id] = [([tok], [-0.5], 1)]
        return res


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    res = runner.execute(out)
    outs = sched.update_from_output(out, res)
    sched.check_invariants()
    return out, outs


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000):
    """Step until nothing is unfinished; returns {req_id: final EngineCoreOutput list}."""
    all_outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return all_outs
        _, outs = step(sched, runner)
        for o in outs:
            all_outs.setdefault(o.req_id, []).append(o)
    raise AssertionError("did not finish")
