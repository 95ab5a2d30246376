"""The step scheduler: one equation, one token budget (pure Python, no torch).

Every request has ``num_tokens`` (prompt + output) and ``num_computed_tokens``; each
``schedule()`` spends up to ``max_num_batched_tokens`` tokens (and at most
``max_num_seqs`` running requests) letting the second catch up with the first:
running requests first (in admission order), then waiting ones. A decode is
the one-token case, a chunked prefill a request that still needs many. When a
running request cannot get blocks, a running request is preempted (blocks
freed, recomputed later from scratch — prompt and output so far).

Scheduling policy (vLLM's ``--scheduling-policy``): "fcfs" admits waiting requests in arrival
order and preempts the newest running request; "priority" keeps the waiting queue ordered by
``(Request.priority, arrival_time)`` (lower value first, ties in arrival order) and preempts the
running request with the largest ``(priority, arrival_time)`` (the lowest priority, latest
arrival); a preempted request goes back to the waiting queue at its place in that order.

``num_computed_tokens`` is advanced at the end of ``schedule()`` (as vLLM v1 does):
the scheduled tokens count as computed as soon as they are handed to the runner.

Speculative decoding: a request's draft tokens (``Request.spec_token_ids``, proposed by the
worker last step) join the equation, ``num_tokens_with_spec - num_computed_tokens``, so the
token budget counts them; drafts that do not fit the budget (or ``max_model_len``, or
``max_tokens``) are dropped. ``update_from_output`` rolls ``num_computed_tokens`` back over the
rejected drafts (their KV slots are rewritten by the next step; block tables only grow and the
prefix cache only hashes blocks of verified tokens, ``Request.all_token_ids``).

Structured outputs: a request with a grammar (``Request.structured_output_request``) waits
as WAITING_FOR_FSM, skipped by admission (others go ahead), until its grammar has compiled;
one whose grammar failed is finished ("abort"). Each sampled token advances its matcher, and
a grammar that has ended finishes the request ("stop").

Jump-forward (``jump_forward_max_tokens > 0``): after a constrained request's new tokens, the
text its grammar forces next (``StructuredOutputRequest.jump_forward_tokens``) becomes its draft
tokens for the next step, verified like speculative drafts (the engine core adds one grammar
bitmask row per draft position; ``SchedulerOutput.structured_output_request_ids`` gives each
request's first row). Counted in ``jump_forward_stats``. Drafts of a configured speculative
method are never used for constrained requests (the worker proposes none for them).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from itertools import repeat
from operator import attrgetter
from typing import Any, Iterable, Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import (_NO_SPEC, EngineCoreOutput, ModelRunnerOutput, ScheduledRequest,
                                        SchedulerOutput)
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm import envs

logger = logging.getLogger("pagedllm")

#: ``--scheduling-policy`` values (vLLM's).
SCHEDULING_POLICIES = ("fcfs", "priority")

# How a request entered this step's batch (``schedule()``'s ``order``): running with the blocks it
# held, running after ``allocate_slots`` (its table may have grown), or (re)admitted.
_KEPT, _ALLOCATED, _NEW = 0, 1, 2
_REQ_ID, _SPEC_IDS, _IS_LAST = attrgetter("req_id"), attrgetter("spec_token_ids"), attrgetter("is_last_chunk")


def _priority_key(req: Request) -> tuple[int, float]:
    """Order of the priority policy: lower ``priority`` first, then earlier arrival."""
    return (req.priority, req.arrival_time)


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        max_num_seqs: most requests in the running set.
        max_num_batched_tokens: token budget per step.
        max_model_len: most tokens (prompt + output) per request.
        kv_cache_manager: the block tables.
        long_prefill_token_threshold: if > 0, a request computes at most this many
            tokens per step (keeps long prefills from starving decodes).
        debug: assert invariants at the end of every ``schedule()``; None reads the
            environment variable ``PAGEDLLM_DEBUG=1``.
        num_spec_tokens: drafts per step when speculative decoding is on (0 = off); sizes
            ``spec_stats``.
        num_lookahead_tokens: extra KV slots allocated past a decoding request's scheduled
            tokens (a draft model writes its own drafts' K/V there).
        max_loras: LoRA: the running set never holds requests of more than this many distinct
            adapters (the workers' slot table); a waiting request whose adapter would exceed
            it is skipped (others go ahead) until one finishes. 0 = no limit (LoRA off).
        connector: the scheduler side of a KV connector (``KVConnectorBase_V1``,
            ``pagedllm.distributed.kv_transfer``) or None. A waiting request's tokens past its
            device prefix hit that the connector can supply (``get_num_new_matched_tokens``) are
            allocated with the rest and marked computed (loaded, not computed; not charged to the
            token budget); a finished request's block table goes to ``request_finished`` before
            it is freed; each step's ``SchedulerOutput.kv_connector_metadata`` is
            ``build_connector_meta``'s.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        kv_cache_manager: KVCacheManager,
        long_prefill_token_threshold: int = 0,
        debug: Optional[bool] = None,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        max_loras: int = 0,
        policy: str = "fcfs",
        connector: Any = None,
        jump_forward_max_tokens: int = 0,
        jump_forward_disable_batch_size: int = 0,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {list(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self._priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_loras = max_loras
        self.connector = connector
        # Waiting requests skipped in the last schedule() because their KV is still arriving.
        self.num_waiting_for_remote_kvs = 0
        self.debug = bool(envs.get("PAGEDLLM_DEBUG")) if debug is None else debug
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished/aborted since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats: Optional[SpecDecodingStats] = (
            SpecDecodingStats(num_spec_tokens) if num_spec_tokens > 0 else None)
        # Jump-forward structured decoding: most grammar draft tokens per step (0 = off).
        self.jump_forward_max_tokens = jump_forward_max_tokens
        # No grammar drafts while this many requests or more run (0: never off).
        self.jump_forward_disable_batch_size = jump_forward_disable_batch_size
        self.jump_forward_stats: Optional[SpecDecodingStats] = (
            SpecDecodingStats(0) if jump_forward_max_tokens > 0 else None)
        # Outputs of requests finished inside schedule() (a grammar that failed to compile),
        # returned by the next update_from_output().
        self._pending_outputs: list[EngineCoreOutput] = []
        # Emit unchanged-decode steps in SchedulerOutput's flat form (not with a KV connector, whose
        # metadata builder may read the step, nor with a speculative method or adapters: their runner
        # paths read ScheduledRequests; constrained requests, jump-forward's, never go flat).
        self._flat_ok = connector is None and num_spec_tokens == 0 and not num_lookahead_tokens and not max_loras

    # ---- bookkeeping ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache (first admissions only)."""
        return self.kv_cache_manager.prefix_cache_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens served from the cache."""
        return self.kv_cache_manager.prefix_cache_stats.hits

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def num_waiting_for_fsm(self) -> int:
        """Waiting requests whose grammar is still compiling."""
        return sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM)

    def has_pending_kv_transfers(self) -> bool:
        """True while the KV connector holds saves that the next step must carry to the workers."""
        return self.connector is not None and self.connector.has_pending_work()

    def has_finished_requests(self) -> bool:
        """True when finished ids still have to reach the runner through a schedule()."""
        return bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING, or WAITING_FOR_FSM with a grammar). Raises
        ValueError on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = (RequestStatus.WAITING if request.structured_output_request is None
                          else RequestStatus.WAITING_FOR_FSM)
        self.requests[request.request_id] = request
        if self._priority:
            self._insert_waiting(request)
        else:
            self.waiting.append(request)

    def _insert_waiting(self, request: Request) -> None:
        """Priority policy: put ``request`` into ``waiting`` after every request whose
        ``(priority, arrival_time)`` is not larger (so equal keys stay in insertion order).
        O(len(waiting)) from the back: new arrivals usually belong near the end."""
        waiting = self.waiting
        key = _priority_key(request)
        i = len(waiting)
        while i > 0 and _priority_key(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, request)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string). Frees their blocks.

        Unknown or already finished ids are ignored. The ids reach the runner in the
        next ``SchedulerOutput.finished_req_ids``; if the request is in flight (scheduled
        but not yet updated), ``update_from_output`` skips it.
        """
        assert RequestStatus.is_finished(finished_status), finished_status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ids = set()
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            ids.add(req_id)
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = finished_status
            self._free_request(req)

    def _free_request(self, request: Request) -> None:
        if self.connector is not None and not self.kv_cache_manager.skip_caching(request):
            # NOTE: the blocks are still intact: saves copy them before the next forward.
            self.connector.request_finished(request, self.kv_cache_manager.req_to_block_ids.get(
                request.request_id, []))
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self._priority:
            self._insert_waiting(request)
        else:
            self.waiting.appendleft(request)

    def _pick_victim(self) -> int:
        """Index in ``running`` of the request to preempt: the newest (fcfs), or the one with the
        largest ``(priority, arrival_time)``, the newest admitted among equals (priority)."""
        running = self.running
        if not self._priority:
            return len(running) - 1
        best = len(running) - 1
        best_key = _priority_key(running[best])
        for j in range(best - 1, -1, -1):
            k = _priority_key(running[j])
            if k > best_key:
                best, best_key = j, k
        return best

    def _cap(self, num_new: int) -> int:
        t = self.long_prefill_token_threshold
        return t if 0 < t < num_new else num_new

    # ---- schedule ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build this step's batch (see module docstring). Mutates request counters."""
        mgr = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        max_model_len = self.max_model_len
        # (request, tokens to compute, _KEPT / _ALLOCATED / _NEW) in batch order.
        order: list[tuple[Request, int, int]] = []
        preempted: set[str] = set()

        # 1. Running requests, oldest first; preempt (the newest, or the lowest priority) when out
        # of blocks.
        running = self.running
        req_to_blocks = mgr.req_to_blocks
        num_cached_block = mgr.num_cached_block
        block_size = mgr.block_size
        caching = mgr.enable_caching
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            if req.spec_token_ids:
                # NOTE: a constrained request's drafts are its grammar's (jump-forward); they get
                # one bitmask row per position (engine core).
                if req.structured_output_request is not None and not self.jump_forward_max_tokens:
                    req.spec_token_ids = []
                else:
                    self._trim_drafts(req)
            # min(_cap(num_tokens_with_spec - computed), budget, max_model_len - computed)
            num_new = len(req.all_token_ids) + len(req.spec_token_ids) - computed
            if 0 < threshold < num_new:
                num_new = threshold
            if budget < num_new:
                num_new = budget
            if max_model_len - computed < num_new:
                num_new = max_model_len - computed
            if req.mm_features:
                num_new = mm_chunk_end(req.mm_features, computed, num_new)
            if num_new <= 0:
                i += 1
                continue
            lookahead = 0
            if self.num_lookahead_tokens and computed + num_new >= len(req.all_token_ids):
                lookahead = max(0, min(self.num_lookahead_tokens, max_model_len - computed - num_new))
            # KVCacheManager.allocate_slots' fast path, inlined (most decode steps): the held blocks
            # have room and no block becomes full, so nothing is allocated or registered.
            held = req_to_blocks.get(req.request_id)
            if held is not None and computed + num_new + lookahead <= len(held) * block_size and (
                    not caching or req.pooling_params is not None
                    or min(computed + num_new + lookahead, len(req.all_token_ids)) // block_size
                    <= num_cached_block[req.request_id]):
                order.append((req, num_new, _KEPT))
                budget -= num_new
                i += 1
                continue
            while True:
                if mgr.allocate_slots(req, num_new + lookahead) is not None:
                    scheduled = True
                    break
                vi = self._pick_victim()
                victim = running.pop(vi)
                if vi < i:
                    # Priority policy: already scheduled this step; give its tokens back.
                    for k, (r, n, _) in enumerate(order):
                        if r is victim:
                            budget += n
                            del order[k]
                            break
                    i -= 1
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue  # running[i] is now the next request (fcfs: none left)
            order.append((req, num_new, _ALLOCATED))
            budget -= num_new
            i += 1

        # 2. Waiting requests in queue order: FCFS, or (priority, arrival) (not in a step that had
        # to preempt: no thrashing).
        self.num_waiting_for_remote_kvs = 0
        if not preempted:
            skipped: list[Request] = []  # grammars still compiling: they keep their place
            # LoRA: adapters of the running set (at most max_loras distinct ones).
            loras = self._running_loras() if self.max_loras else None
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if req.status == RequestStatus.WAITING_FOR_FSM:
                    sor = req.structured_output_request
                    if not sor.is_ready():
                        skipped.append(self.waiting.popleft())
                        continue
                    err = sor.error()
                    if err is not None:
                        self.waiting.popleft()
                        self._fail_request(req, err)
                        continue
                    req.status = RequestStatus.WAITING
                lora = req.lora_request
                if (loras is not None and lora is not None and lora.lora_int_id not in loras
                        and len(loras) >= self.max_loras):
                    skipped.append(self.waiting.popleft())  # its adapter would need one slot too many
                    continue
                hit_blocks, num_hit = mgr.get_computed_blocks(req)
                num_ext = 0
                if self.connector is not None and not mgr.skip_lookup(req):
                    ext = self.connector.get_num_new_matched_tokens(req, num_hit)[0]
                    if ext is None:  # KV still arriving (P2pConnector): it keeps its place
                        self.num_waiting_for_remote_kvs += 1
                        skipped.append(self.waiting.popleft())
                        continue
                    num_ext = ext
                req.num_computed_tokens = 0
                num_new = min(self._cap(req.num_tokens - num_hit - num_ext), budget)
                if req.mm_features:
                    num_new = mm_chunk_end(req.mm_features, num_hit + num_ext, num_new)
                    if num_new <= 0:
                        break
                if mgr.allocate_slots(req, num_ext + num_new, hit_blocks) is None:
                    break
                self.waiting.popleft()
                if self.connector is not None:
                    bs = mgr.block_size
                    ext_blocks = mgr.req_to_blocks[req.request_id][num_hit // bs:(num_hit + num_ext) // bs]
                    self.connector.update_state_after_alloc(req, ext_blocks, num_ext)
                    num_hit += num_ext
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.time()
                req.num_computed_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if loras is not None and lora is not None:
                    loras.add(lora.lora_int_id)
                order.append((req, num_new, _NEW))
                budget -= num_new
            if skipped:
                self.waiting.extendleft(reversed(skipped))

        # 3. Emit and advance num_computed_tokens.
        out = SchedulerOutput(
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        block_ids = mgr.req_to_block_ids
        if self._flat_ok and order and self._emit_flat(out, order, block_ids):
            return out
        scheduled_reqs = out.scheduled
        grammar_rows = out.structured_output_request_ids
        num_grammar_rows = 0
        total = 0
        for req, n, kind in order:
            start = req.num_computed_tokens
            tokens = req.all_token_ids
            spec: list[int] = _NO_SPEC
            if req.spec_token_ids:
                # Drafts that fit this step's count; the rest are dropped (re-proposed later).
                num_spec = start + n - len(tokens)
                if num_spec > 0:
                    del req.spec_token_ids[num_spec:]
                    spec = req.spec_token_ids
                else:
                    req.spec_token_ids = []
            if req.structured_output_request is not None and start + n >= len(tokens):
                grammar_rows[req.request_id] = num_grammar_rows  # first row; one per draft follows
                num_grammar_rows += 1 + len(spec)
            prompt_len = len(req.prompt_token_ids)
            in_prompt = start < prompt_len
            # NOTE: positional (the field order of ScheduledRequest): keyword arguments cost ~2x as
            # much per request per step.
            scheduled_reqs.append(ScheduledRequest(
                req.request_id, tokens, start, n, block_ids[req.request_id].copy(),
                start + n >= len(tokens), req.sampling_params, req.pooling_params, prompt_len,
                kind == _NEW, spec, req.lora_request,
                req.prompt_embeds if in_prompt else None, req.mm_features if in_prompt else None))
            req.num_computed_tokens = start + n
            total += n
        out.total_num_scheduled_tokens = total
        if self.debug:
            self.check_invariants(out)
        return out

    def _emit_flat(self, out: SchedulerOutput, order: list[tuple[Request, int, int]], block_ids: dict[str, list[int]]) -> bool:
        """Emit the step in ``SchedulerOutput``'s flat form when every request in ``order`` is an
        unchanged decode (see ``SchedulerOutput``); returns False, having changed nothing, when
        one is not (then the general form is emitted)."""
        ids: list[str] = []
        starts: list[int] = []
        toks: list[int] = []
        sources: list[tuple[Request, list[int], int]] = []
        grown: dict[str, list[int]] = {}
        for req, n, kind in order:
            start = req.num_computed_tokens
            tokens = req.all_token_ids
            if (n != 1 or kind == _NEW or start + 1 != len(tokens) or req.structured_output_request is not None
                    or req.pooling_params is not None or start < len(req.prompt_token_ids)):
                for r in order[:len(ids)]:  # roll back: the general form advances them
                    r[0].num_computed_tokens -= 1
                return False
            rid = req.request_id
            ids.append(rid)
            starts.append(start)
            toks.append(tokens[start])
            blocks = block_ids[rid]
            sources.append((req, blocks, len(blocks)))
            if kind == _ALLOCATED:
                grown[rid] = blocks.copy()
            req.num_computed_tokens = start + 1
        for req, _, _ in order:
            if req.spec_token_ids:
                req.spec_token_ids = []  # (none fit a one-token step: dropped, as the general form does)
        out.cached_req_ids = ids
        out.cached_start_pos = starts
        out.cached_token_ids = toks
        out.cached_new_block_ids = grown
        out.set_flat(sources)
        out.total_num_scheduled_tokens = len(ids)
        if self.debug:
            self.check_invariants(out)
        return True

    def _running_loras(self) -> set[int]:
        """Adapter ids of the running requests."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def lora_adapter_names(self) -> tuple[list[str], list[str]]:
        """``(running, waiting)``: sorted names of the adapters of running / waiting requests
        (vLLM's ``lora_requests_info`` labels)."""
        running = {r.lora_request.lora_name for r in self.running if r.lora_request is not None}
        waiting = {r.lora_request.lora_name for r in self.waiting if r.lora_request is not None}
        return sorted(running), sorted(waiting)

    def check_invariants(self, out: Optional[SchedulerOutput] = None) -> None:
        """Assert block, budget and counter invariants (debug builds and tests)."""
        mgr = self.kv_cache_manager
        mgr.check_invariants()
        assert len(self.running) <= self.max_num_seqs, (len(self.running), self.max_num_seqs)
        assert set(mgr.req_to_blocks) == {r.request_id for r in self.running}, "block tables != running"
        for req in self.running:
            assert req.status == RequestStatus.RUNNING, req
            assert 0 <= req.num_computed_tokens <= req.num_tokens_with_spec, req
            assert len(mgr.req_to_blocks[req.request_id]) * mgr.block_size >= req.num_computed_tokens, req
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM,
                                  RequestStatus.PREEMPTED), req
            assert req.num_computed_tokens == 0, req
        if self._priority:
            keys = [_priority_key(r) for r in self.waiting]
            assert keys == sorted(keys), "priority policy: waiting queue out of order"
        assert len(self.requests) == len(self.running) + len(self.waiting)
        if self.max_loras:
            assert len(self._running_loras()) <= self.max_loras, (self._running_loras(), self.max_loras)
        if out is not None and out.is_flat:  # (checked without building ``scheduled``)
            n = len(out.cached_req_ids)
            assert out.total_num_scheduled_tokens == n <= self.max_num_batched_tokens
            assert len(set(out.cached_req_ids)) == n == len(out.cached_start_pos) == len(out.cached_token_ids)
            for rid, start, tok in zip(out.cached_req_ids, out.cached_start_pos, out.cached_token_ids):
                req = self.requests[rid]
                assert req.num_computed_tokens == start + 1 == len(req.all_token_ids), req
                assert req.all_token_ids[start] == tok, req
        elif out is not None:
            assert out.total_num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
            assert out.total_num_scheduled_tokens <= self.max_num_batched_tokens
            assert all(s.num_tokens >= 1 for s in out.scheduled)
            assert len({s.req_id for s in out.scheduled}) == len(out.scheduled)

    # ---- update --------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns one ``EngineCoreOutput`` per request that got new tokens, new prompt
        logprobs, or finished. Requests finished via ``finish_requests`` while in
        flight are skipped.
        """
        outputs: list[EngineCoreOutput] = self._pending_outputs
        self._pending_outputs = []
        # Grammar drafts only in small batches (``jump_forward_disable_batch_size``).
        jf_on = not self.jump_forward_disable_batch_size or len(self.running) < self.jump_forward_disable_batch_size
        if self.connector is not None:
            self.connector.update_connector_output(runner_output.kv_connector_output)
        any_finished = False
        requests = self.requests
        sampled = runner_output.sampled_token_ids
        all_logprobs = runner_output.logprobs
        all_prompt_lps = runner_output.prompt_logprobs
        spec_out = runner_output.spec_token_ids
        max_model_len = self.max_model_len
        jump_forward = self.jump_forward_max_tokens
        preempted_status = RequestStatus.PREEMPTED
        running_status = RequestStatus.RUNNING
        so = scheduler_output
        if so.is_flat:  # (every request: one token, no drafts, its last chunk)
            n = len(so.cached_req_ids)
            items: Iterable[tuple[str, list[int], bool]] = zip(so.cached_req_ids, repeat(_NO_SPEC, n), repeat(True, n))
        else:
            sched = so.scheduled
            items = zip(map(_REQ_ID, sched), map(_SPEC_IDS, sched), map(_IS_LAST, sched))
        for req_id, spec, is_last_chunk in items:
            req = requests.get(req_id)
            if req is None or req.status != running_status:
                continue  # aborted (or otherwise gone) while in flight
            prompt_lps = all_prompt_lps.get(req_id) if all_prompt_lps else None
            if req.pooling_params is not None:
                if is_last_chunk:
                    # NOTE: finish even if the runner gave no pooled output, or the request
                    # would sit in `running` with nothing left to compute, forever.
                    req.status = RequestStatus.FINISHED_STOPPED
                    any_finished = True
                    outputs.append(EngineCoreOutput(
                        req_id=req_id, new_token_ids=[], finish_reason="stop",
                        pooled=runner_output.pooler_output.get(req_id),
                        num_cached_tokens=max(req.num_cached_tokens, 0)))
                continue
            new_ids = sampled.get(req_id)
            if spec:
                # Roll back over the rejected drafts: their K/V slots are rewritten next step.
                num_accepted = min(len(new_ids) - 1, len(spec)) if new_ids else 0
                req.num_computed_tokens -= len(spec) - num_accepted
                stats = (self.jump_forward_stats if req.structured_output_request is not None
                         else self.spec_stats)
                if stats is not None:
                    stats.observe_draft(len(spec), num_accepted)
            if new_ids:
                if len(new_ids) == 1:  # (the common case: one token, no copy of the list)
                    tok = new_ids[0]
                    out_ids = req.output_token_ids
                    out_ids.append(tok)
                    all_ids = req.all_token_ids
                    all_ids.append(tok)
                    appended = new_ids
                    # _check_stop, inlined for the token that stops nothing (same checks, same order)
                    if (len(out_ids) >= req.min_tokens
                            and (req.stop_token_ids is not None or (tok == req.eos_token_id and not req.ignore_eos))
                            or (req.max_tokens is not None and len(out_ids) >= req.max_tokens)
                            or len(all_ids) >= max_model_len):
                        self._check_stop(req)
                else:
                    appended = []
                    for tok in new_ids:
                        req.output_token_ids.append(tok)
                        req.all_token_ids.append(tok)
                        appended.append(tok)
                        if self._check_stop(req):
                            break
                sor = req.structured_output_request
                if sor is not None:
                    self._advance_grammar(req, sor, appended)
            elif not prompt_lps:
                continue
            else:
                appended = []
            lps = all_logprobs.get(req_id) if all_logprobs else None
            if lps is not None:
                lps = lps[:len(appended)]
            status = req.status
            finished = status > preempted_status
            any_finished |= finished
            if not finished and new_ids:
                if sor is not None and jump_forward:
                    req.spec_token_ids = self._jump_forward_drafts(req, sor) if jf_on else []
                elif spec_out:
                    req.spec_token_ids = spec_out.get(req_id) or []
                elif req.spec_token_ids:
                    req.spec_token_ids = []
            ncached = req.num_cached_tokens
            if finished or ncached > 0 or req.stop_reason is not None:
                outputs.append(EngineCoreOutput(
                    req_id, appended, lps, prompt_lps, RequestStatus.finish_reason(status) if finished else None,
                    req.stop_reason, None, ncached if ncached > 0 else 0))
            else:  # (the defaults: no finish, no stop reason, nothing cached)
                outputs.append(EngineCoreOutput(req_id, appended, lps, prompt_lps))
        if any_finished:
            still = []
            for req in self.running:
                if req.is_finished():
                    self._free_request(req)
                else:
                    still.append(req)
            self.running = still
        return outputs

    def _trim_drafts(self, req: Request) -> None:
        """Drop drafts that could only be verified past ``max_tokens`` (at most
        ``max_tokens - num_output - 1`` of them lead to an emitted token)."""
        if req.max_tokens is not None:
            room = req.max_tokens - len(req.output_token_ids) - 1
            if room < len(req.spec_token_ids):
                del req.spec_token_ids[max(room, 0):]

    def _jump_forward_drafts(self, req: Request, sor: Any) -> list[int]:
        """The grammar's forced continuation as draft tokens for ``req``'s next step: at most
        ``jump_forward_max_tokens``, and only as many as can lead to an emitted token
        (``max_tokens``, ``max_model_len``)."""
        cap = self.jump_forward_max_tokens
        if req.max_tokens is not None:
            cap = min(cap, req.max_tokens - len(req.output_token_ids) - 1)
        cap = min(cap, self.max_model_len - len(req.all_token_ids) - 1)
        return sor.jump_forward_tokens(cap) if cap > 0 else []

    def _advance_grammar(self, req: Request, sor: Any, new_ids: list[int]) -> None:
        """Advance the request's matcher over its new tokens; a token the grammar refuses (a
        bug: the bitmask allowed it) aborts the request, an ended grammar stops it."""
        if not sor.accept_tokens(new_ids):
            logger.error("request %s: sampled token(s) %s are not allowed by its grammar; aborting it",
                         req.request_id, new_ids)
            req.status = RequestStatus.FINISHED_ABORTED
        elif req.status == RequestStatus.RUNNING and sor.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED

    def _fail_request(self, req: Request, error: str) -> None:
        """Finish a waiting request whose grammar could not be compiled ("abort")."""
        logger.error("request %s: structured output grammar failed to compile: %s", req.request_id, error)
        req.status = RequestStatus.FINISHED_ABORTED
        self._free_request(req)
        self._pending_outputs.append(EngineCoreOutput(
            req_id=req.request_id, new_token_ids=[], finish_reason="abort"))

    def _check_stop(self, req: Request) -> bool:
        """Stop checks after appending one token, in order: stop_token_ids, EOS (both
        gated by min_tokens), max_tokens, max_model_len. Sets status/stop_reason."""
        out = req.output_token_ids
        num_out = len(out)
        if num_out >= req.min_tokens:
            last = out[-1]
            stop_ids = req.stop_token_ids
            if stop_ids is not None and last in stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
            if last == req.eos_token_id and not req.ignore_eos:  # (eos None: never equal)
                req.status = RequestStatus.FINISHED_STOPPED
                return True
        max_tokens = req.max_tokens
        if max_tokens is not None and num_out >= max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        if len(req.all_token_ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


def mm_chunk_end(features: list[Any], start: int, num_new: int) -> int:
    """``num_new`` cut so that the chunk ``[start, start + num_new)`` does not end inside the
    placeholder run of a feature whose tokens attend bidirectionally (``feature.bidirectional``;
    vLLM's ``disable_chunked_mm_input``): the chunk stops before the run (0 when it starts inside
    the run and cannot reach its end). Causal features may be split anywhere (the model runner
    takes the encoder output's slice)."""
    end = start + num_new
    for f in features:
        a, b = f.offset, f.offset + f.length
        if f.bidirectional and a < end < b:
            end = a if a > start else start
    return end - start
