"""A compact wire form of ``SchedulerOutput`` for workers in other processes.

A ``ScheduledRequest`` carries the request's whole token list and block table every step (by
reference, free in-process). Pickled for every rank every step, a batch of 64 requests of 1,000
tokens is ~64k ints. Like vLLM's ``NewRequestData`` / ``CachedRequestData``, the encoder sends
a request's parameters and tokens once, then per step only the tokens and block ids the worker
has not seen; the decoder keeps a mirror of each request and rebuilds the ``ScheduledRequest``.

What is sent per scheduled request:

* new (``is_new``: first admission or re-admission after preemption): ``token_ids[:end]``
  (``end = start_pos + num_tokens``), all block ids, sampling/pooling params, prompt length, LoRA
  adapter;
* running: ``token_ids[off:end]`` with ``off = min(sent, start_pos)`` (tokens below
  ``start_pos`` are computed and never change; restarting at ``start_pos`` would also cover
  replaced draft tokens), and the block ids past those sent (block tables only grow while a
  request runs: ``KVCacheManager.allocate_slots`` appends).

The mirror's token list is ``token_ids[:end]``: everything the runner reads
(``token_ids[start_pos:end]``, the prompt, the output so far for penalties).
Finished and preempted ids drop the mirror entry on both sides.
"""
from __future__ import annotations

from typing import Any

from pagedllm.core.sched_output import ScheduledRequest, SchedulerOutput


class SchedulerOutputEncoder:
    """Engine side: ``encode(so)`` -> a picklable tuple; keeps what each worker has seen.

    ``defer(so)`` holds an empty step's finished/preempted ids for the next encoded step (a
    round trip to the workers for nothing but frees is not worth it).
    """

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}  # req_id -> [tokens sent, block ids sent]
        self._finished: set[str] = set()
        self._preempted: set[str] = set()

    def defer(self, so: SchedulerOutput) -> None:
        self._finished |= so.finished_req_ids
        self._preempted |= so.preempted_req_ids
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._sent.pop(rid, None)

    def encode(self, so: SchedulerOutput) -> tuple:
        """``(finished ids, preempted ids, total tokens, [request tuples])`` (see module doc)."""
        sent = self._sent
        finished = so.finished_req_ids | self._finished if self._finished else so.finished_req_ids
        preempted = so.preempted_req_ids | self._preempted if self._preempted else so.preempted_req_ids
        self._finished, self._preempted = set(), set()
        for rid in finished:
            sent.pop(rid, None)
        for rid in preempted:
            sent.pop(rid, None)
        reqs: list[tuple] = []
        for r in so.scheduled:
            # NOTE: draft tokens (spec_token_ids) are counted in num_tokens but not in token_ids.
            end = min(r.start_pos + r.num_tokens, len(r.token_ids))
            st = None if r.is_new else sent.get(r.req_id)
            if st is None:
                reqs.append((r.req_id, r.token_ids[:end], r.start_pos, r.num_tokens, r.block_ids,
                             r.is_last_chunk, r.sampling_params, r.pooling_params, r.prompt_len, r.is_new,
                             r.spec_token_ids, r.lora_request))
                sent[r.req_id] = [end, len(r.block_ids)]
                continue
            off = min(st[0], r.start_pos)
            nb = st[1]
            blocks = r.block_ids
            reqs.append((r.req_id, off, r.token_ids[off:end], r.start_pos, r.num_tokens,
                         blocks[nb:] if len(blocks) > nb else (), r.is_last_chunk, r.spec_token_ids))
            st[0], st[1] = end, len(blocks)
        return (finished, preempted, so.total_num_scheduled_tokens, reqs)


class SchedulerOutputDecoder:
    """Worker side: ``decode(payload)`` -> ``SchedulerOutput`` with full ``ScheduledRequest``s.

    Raises:
        KeyError: a running request the decoder never saw as new (encoder/decoder out of step).
    """

    def __init__(self) -> None:
        # req_id -> [token ids, block ids, sampling params, pooling params, prompt len, LoRA request]
        self._reqs: dict[str, list[Any]] = {}

    def decode(self, payload: tuple) -> SchedulerOutput:
        finished, preempted, total, reqs = payload
        mirror = self._reqs
        for rid in finished:
            mirror.pop(rid, None)
        for rid in preempted:
            mirror.pop(rid, None)
        scheduled: list[ScheduledRequest] = []
        for t in reqs:
            if len(t) == 12:
                rid, tokens, start, n, blocks, last, sp, pp, prompt_len, is_new, spec, lora = t
                tokens, blocks = list(tokens), list(blocks)
                mirror[rid] = [tokens, blocks, sp, pp, prompt_len, lora]
            else:
                rid, off, new_tokens, start, n, new_blocks, last, spec = t
                m = mirror[rid]
                tokens, blocks, sp, pp, prompt_len, lora = m
                if len(tokens) != off:
                    del tokens[off:]
                tokens.extend(new_tokens)
                if new_blocks:
                    blocks.extend(new_blocks)
                is_new = False
            scheduled.append(ScheduledRequest(rid, tokens, start, n, blocks.copy() if is_new else blocks,
                                              last, sp, pp, prompt_len, is_new, list(spec), lora))
        return SchedulerOutput(scheduled=scheduled, total_num_scheduled_tokens=total,
                               finished_req_ids=set(finished), preempted_req_ids=set(preempted))
