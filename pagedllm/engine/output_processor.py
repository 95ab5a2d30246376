"""Front-end output side: EngineCoreOutputs -> RequestOutputs.

Per request (one sample) a :class:`RequestState` detokenizes new tokens incrementally,
applies stop strings (the engine core knows only stop token ids), converts logprobs and
builds :class:`~pagedllm.outputs.RequestOutput` objects according to
``SamplingParams.output_kind``. Requests with ``n > 1`` are fanned out by the engine into
``n`` child requests (ids ``f"{i}_{parent_id}"``); a :class:`ParentRequest` fans their
outputs back into one RequestOutput per step.

Pooling requests (registered with a ``PoolingParams``) get a :class:`PoolingRequestState`:
their one output, after the last prefill chunk, becomes a
:class:`~pagedllm.outputs.PoolingRequestOutput`.

``OutputProcessor.process_outputs`` returns the RequestOutputs / PoolingRequestOutputs (for
requests registered without a queue) and the ids the engine core must abort because a stop
string matched.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Optional, Sequence

from pagedllm.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    normalize_stop,
    stop_holdback,
)
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestOutput,
)

CUMULATIVE = 0
DELTA = 1
FINAL_ONLY = 2


def _output_kind(params: Any) -> int:
    kind = getattr(params, "output_kind", CUMULATIVE)
    if kind is None:
        return CUMULATIVE
    return int(getattr(kind, "value", kind))


def _as_list(x: Any) -> list[Any]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def convert_logprobs_entry(
    entry: Any, token_text: Optional[Callable[[int], str]] = None
) -> Optional[PositionLogprobs]:
    """Runner tuple ``(token_ids, logprobs, sampled_rank)`` -> ``{token_id: Logprob}``.

    ``token_ids[0]`` is the sampled (or prompt) token with rank ``sampled_rank``; the rest
    are the top-k with ranks 1..k. The sampled token stays first in the dict; if it also
    appears among the top-k, its first entry is kept. ``None`` passes through.
    """
    if entry is None:
        return None
    ids, lps, sampled_rank = entry
    ids = _as_list(ids)
    lps = _as_list(lps)
    out: PositionLogprobs = {}
    for j, (tid, lp) in enumerate(zip(ids, lps)):
        tid = int(tid)
        if tid in out:
            continue
        rank = int(sampled_rank) if j == 0 else j
        out[tid] = Logprob(float(lp), rank, token_text(tid) if token_text else None)
    return out


class ParentRequest:
    """Aggregates the ``n`` child requests of one user request.

    Attributes:
        request_id: the user-facing id.
        sampling_params: the user's params (``n`` samples).
        n: number of children.
        queue: optional asyncio-like queue receiving the aggregated RequestOutputs.
    """

    def __init__(self, request_id: str, sampling_params: Any, queue: Any = None) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = int(getattr(sampling_params, "n", 1) or 1)
        self.queue = queue
        self.output_kind = _output_kind(sampling_params)
        self.child_ids: dict[int, str] = {}  # index -> child id (registered children)
        self.finished_indices: set[int] = set()
        self.latest: dict[int, Optional[CompletionOutput]] = {}  # CUMULATIVE / FINAL_ONLY state
        self.prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
        self.prompt_logprobs_owner: Optional[int] = None  # child index providing them
        self.prompt_logprobs_sent = 0
        self.num_cached_tokens = 0
        self.prompt: Optional[str] = None
        self.prompt_token_ids: list[int] = []
        self.metrics: dict[str, Any] = {}

    @staticmethod
    def child_request_id(index: int, parent_id: str) -> str:
        return f"{index}_{parent_id}"

    def get_child_info(self, index: int) -> tuple[str, Any]:
        """``(child_request_id, child_params)``: params copied with ``n=1`` and, when the
        parent is seeded, ``seed + index`` so the samples differ but stay reproducible."""
        p = self.sampling_params
        clone = getattr(p, "clone", None)
        child = clone() if callable(clone) else copy.deepcopy(p)
        try:
            child.n = 1
            seed = getattr(child, "seed", None)
            if seed is not None:
                child.seed = seed + index
        except AttributeError:  # pragma: no cover - frozen params
            pass
        return self.child_request_id(index, self.request_id), child

    @property
    def finished(self) -> bool:
        return len(self.finished_indices) >= self.n


class RequestState:
    """One sample's output state (a standalone request or a child of a ParentRequest)."""

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: Sequence[int],
        params: Any,
        parent: Optional[ParentRequest],
        index: int,
        tokenizer: Any,
        arrival_time: Optional[float],
        queue: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.parent = parent
        self.index = index
        self.queue = queue
        self.output_kind = _output_kind(params)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: Optional[float] = None

        detok = bool(getattr(params, "detokenize", True)) and tokenizer is not None
        self.tokenizer = tokenizer
        self.detokenizer: Optional[IncrementalDetokenizer] = (
            IncrementalDetokenizer(
                tokenizer,
                self.prompt_token_ids,
                skip_special_tokens=bool(getattr(params, "skip_special_tokens", True)),
                spaces_between_special_tokens=bool(
                    getattr(params, "spaces_between_special_tokens", True)),
            )
            if detok else None
        )
        self.stop: list[str] = normalize_stop(getattr(params, "stop", None)) if detok else []
        self.include_stop = bool(getattr(params, "include_stop_str_in_output", False))
        self.min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        self.logprobs_requested = getattr(params, "logprobs", None) is not None
        self.prompt_logprobs_requested = getattr(params, "prompt_logprobs", None) is not None

        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: Optional[list[PositionLogprobs]] = [] if self.logprobs_requested else None
        self.cumulative_logprob: Optional[float] = 0.0 if self.logprobs_requested else None
        self.prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = (
            [] if self.prompt_logprobs_requested else None)
        self.prompt_logprobs_sent = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None
        self.num_cached_tokens = 0
        # DELTA bookkeeping: how much was already sent.
        self.sent_text = 0
        self.sent_tokens = 0
        # A request with no stop strings, logprobs or prompt logprobs: a step that brings one token
        # and no news otherwise takes update()'s short path.
        self._plain = not self.stop and not self.logprobs_requested and not self.prompt_logprobs_requested
        # ... and one that sends nothing before its end (offline ``LLM.generate``, n = 1): such a
        # step is handled inside ``OutputProcessor.process_outputs``' loop (no update() call).
        self._plain_final = self._plain and self.output_kind == FINAL_ONLY and parent is None
        # ... whose text nobody reads before the end either: its tokens are detokenized once, when
        # it finishes (IncrementalDetokenizer.defer_tokens), instead of one delta per step.
        self._defer_text = self._plain_final and self.detokenizer is not None and self.detokenizer.can_defer

    # ------------------------------------------------------------------ helpers
    def _token_text(self) -> Optional[Callable[[int], str]]:
        return self.detokenizer.get_token_text if self.detokenizer is not None else None

    def _add_prompt_logprobs(self, entries: Sequence[Any]) -> None:
        if self.prompt_logprobs is None:
            return
        fn = self._token_text()
        for k, e in enumerate(entries):
            if not self.prompt_logprobs and k == 0 and e is not None:
                self.prompt_logprobs.append(None)  # position 0 has no logprob
            if len(self.prompt_logprobs) >= len(self.prompt_token_ids):
                break
            self.prompt_logprobs.append(convert_logprobs_entry(e, fn))

    def _releasable_len(self) -> int:
        if self.finish_reason is not None or not self.stop or self.include_stop:
            return len(self.text)
        return len(self.text) - stop_holdback(self.text, self.stop)

    # ------------------------------------------------------------------ one step
    def _plain_step(self, eco: Any) -> bool:
        """For a ``_plain`` request: apply ``eco`` if it is the common decode step (one int token,
        not finished, no prompt logprobs, no news in the cached count; the same result as
        :meth:`update`'s general path) and return True; else change nothing, return False."""
        new_ids = eco.new_token_ids
        if (eco.finish_reason is None and type(new_ids) is list and len(new_ids) == 1
                and self.first_token_time is not None and not eco.new_prompt_logprobs
                and type(new_ids[0]) is int
                and (not eco.num_cached_tokens or eco.num_cached_tokens <= self.num_cached_tokens)):
            self.token_ids.append(new_ids[0])
            if self._defer_text:
                return True  # (the detokenizer catches up at the end: update())
            det = self.detokenizer
            if det is not None:
                delta = det.add_tokens(new_ids)
                if delta:
                    self.text += delta
            return True
        return False

    def update(self, eco: Any) -> bool:
        """Apply one EngineCoreOutput. Returns True when a stop string matched while the
        core still runs the request (so the core must abort it)."""
        if self._plain and self._plain_step(eco):
            return False  # (the common decode step: append, detokenize)
        if self._defer_text:  # the tokens _plain_step appended without text, into the detokenizer
            det = self.detokenizer
            assert det is not None  # (_defer_text implies one)
            behind = len(self.token_ids) - det.num_output_tokens
            if behind > 0:
                det.defer_tokens(self.token_ids[-behind:])
        if eco.num_cached_tokens and eco.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = int(eco.num_cached_tokens)
        if eco.new_prompt_logprobs:
            self._add_prompt_logprobs(eco.new_prompt_logprobs)

        new_ids = eco.new_token_ids
        if new_ids:
            if not (type(new_ids) is list and len(new_ids) == 1 and type(new_ids[0]) is int):
                new_ids = [int(t) for t in new_ids]  # (one int, the common case, is used as is)
            if self.first_token_time is None:
                self.first_token_time = time.time()
            self.token_ids.extend(new_ids)
        else:
            new_ids = []

        if self.logprobs is not None and eco.new_logprobs:
            fn = self._token_text()
            for entry in eco.new_logprobs:
                d = convert_logprobs_entry(entry, fn)
                self.logprobs.append(d if d is not None else {})
                if entry is not None and self.cumulative_logprob is not None:
                    self.cumulative_logprob += float(_as_list(entry[1])[0])

        core_finish = eco.finish_reason
        abort = False
        if self.detokenizer is not None:
            to_detok = new_ids
            # A stop token / EOS that ended the request is not part of the text unless
            # include_stop_str_in_output (vLLM).
            if core_finish == "stop" and not self.include_stop and to_detok:
                to_detok = to_detok[:-1]
            prev_len = len(self.text)
            delta = self.detokenizer.add_tokens(to_detok)
            if core_finish is not None:
                delta += self.detokenizer.flush()
            if delta:
                self.text += delta
            if self.stop and delta and len(self.token_ids) > self.min_tokens:
                hit = find_stop_string(self.text, prev_len, self.stop)
                if hit is not None:
                    s, start = hit
                    self.text = self.text[: start + len(s) if self.include_stop else start]
                    self.finish_reason = "stop"
                    self.stop_reason = s
                    abort = core_finish is None
                    return abort
        if core_finish is not None:
            self.finish_reason = core_finish
            self.stop_reason = eco.stop_reason
        return abort

    def make_completion_output(self, force_cumulative: bool = False) -> Optional[CompletionOutput]:
        """The CompletionOutput for this step according to ``output_kind`` (None for
        FINAL_ONLY before the end)."""
        kind = CUMULATIVE if force_cumulative else self.output_kind
        finished = self.finish_reason is not None
        if kind == FINAL_ONLY and not finished:
            return None
        end = self._releasable_len()
        if kind == DELTA:
            text = self.text[self.sent_text:end]
            token_ids = self.token_ids[self.sent_tokens:]
            logprobs = (self.logprobs[self.sent_tokens:]
                        if self.logprobs is not None else None)
            self.sent_text = max(self.sent_text, end)
            self.sent_tokens = len(self.token_ids)
        else:
            text = self.text[:end]
            token_ids = list(self.token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def take_prompt_logprobs(self, kind: int) -> Optional[list[Optional[PositionLogprobs]]]:
        if self.prompt_logprobs is None:
            return None
        if kind == DELTA:
            if self.prompt_logprobs_sent >= len(self.prompt_logprobs):
                return None
            out = self.prompt_logprobs[self.prompt_logprobs_sent:]
            self.prompt_logprobs_sent = len(self.prompt_logprobs)
            return out
        return list(self.prompt_logprobs)

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {"arrival_time": self.arrival_time,
                             "first_token_time": self.first_token_time}
        if self.finish_reason is not None:
            m["finished_time"] = time.time()
        return m


class PoolingRequestState:
    """A pooling request waiting for its pooled output (prefill only: one output at the end)."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: Sequence[int],
                 params: Any, queue: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.queue = queue
        self.parent = None

    def make_output(self, eco: Any) -> PoolingRequestOutput:
        """The PoolingRequestOutput of the finishing EngineCoreOutput ``eco``.

        Raises:
            RuntimeError: the request finished without a pooled tensor (an engine bug).
        """
        if eco.pooled is None:
            raise RuntimeError(f"pooling request {self.request_id} finished without a pooled output")
        return PoolingRequestOutput(request_id=self.request_id, outputs=PoolingOutput(eco.pooled),
                                    prompt_token_ids=self.prompt_token_ids, finished=True)


class OutputProcessor:
    """Turns the engine core's per-step outputs into RequestOutputs (PoolingRequestOutputs for
    pooling requests).

    Attributes:
        request_states: core request id -> RequestState (unfinished requests only).
        parent_requests: parent id -> ParentRequest (while any child is unfinished).
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer  # default when add_request gets none
        self.request_states: dict[str, "RequestState | PoolingRequestState"] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: Sequence[int],
        params: Any,
        parent: Optional[ParentRequest] = None,
        index: int = 0,
        tokenizer: Any = None,
        arrival_time: Optional[float] = None,
        queue: Any = None,
    ) -> None:
        """Register one (child) request. With ``queue`` (anything with ``put_nowait``),
        its RequestOutputs go there instead of being returned by ``process_outputs``; for
        a child, the queue is attached to its parent (give it once, or set
        ``ParentRequest.queue``). ``params`` a PoolingParams: a pooling request (no parent).

        Raises:
            ValueError: ``request_id`` is already registered.
        """
        from pagedllm.pooling_params import PoolingParams

        if request_id in self.request_states:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            self.request_states[request_id] = PoolingRequestState(
                request_id, prompt, prompt_token_ids, params, queue)
            return
        if tokenizer is None:
            tokenizer = self.tokenizer
        if parent is not None:
            if queue is not None:
                parent.queue = queue
            queue = None
            self.parent_requests[parent.request_id] = parent
            parent.child_ids[index] = request_id
            parent.prompt = prompt
            parent.prompt_token_ids = list(prompt_token_ids)
            if "arrival_time" not in parent.metrics:
                parent.metrics["arrival_time"] = (
                    time.time() if arrival_time is None else arrival_time)
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, parent, index, tokenizer,
            arrival_time, queue)

    def abort_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Forget the given requests (user-facing parent ids expand to their children).
        Returns the core request ids that were removed (to abort in the engine core).
        No output is produced for them."""
        removed: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.pop(rid, None)
            if parent is not None:
                for cid in parent.child_ids.values():
                    if self.request_states.pop(cid, None) is not None:
                        removed.append(cid)
                continue
            state = self.request_states.pop(rid, None)
            if state is None:
                continue
            removed.append(rid)
            p = getattr(state, "parent", None)   # pooling requests have no parent (n = 1)
            if p is not None and isinstance(state, RequestState):
                p.finished_indices.add(state.index)
                if p.finished:
                    self.parent_requests.pop(p.request_id, None)
        return removed

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # ------------------------------------------------------------------ step
    def process_outputs(
        self, engine_core_outputs: Sequence[Any]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Consume one step's EngineCoreOutputs.

        Returns ``(request_outputs, reqs_to_abort)``: the RequestOutputs (PoolingRequestOutputs
        for pooling requests) of requests without a queue (queued ones are ``put_nowait``
        instead), and the core request ids whose stop string matched (the core must abort
        them). Outputs for unknown (finished/aborted) ids are ignored. A request with ``n > 1``
        yields at most one RequestOutput per call.

        Raises:
            RuntimeError: a pooling request without a queue finished without a pooled output
                (with a queue, the error goes to the queue).
        """
        results: list[Any] = []  # RequestOutputs and PoolingRequestOutputs
        reqs_to_abort: list[str] = []
        parent_updates: dict[str, list[RequestState]] = {}

        states = self.request_states
        for eco in engine_core_outputs:
            state = states.get(eco.req_id)
            if state is None:
                continue
            if type(state) is RequestState and state._plain_final and state._plain_step(eco):
                continue  # (nothing to send before the end)
            if isinstance(state, PoolingRequestState):
                if eco.finish_reason is None:
                    continue  # NOTE: the core sends a pooling request's output only at its end
                del self.request_states[state.request_id]
                try:
                    pooled = state.make_output(eco)
                except RuntimeError as e:
                    if state.queue is None:
                        raise
                    state.queue.put_nowait(e)
                    continue
                self._deliver(pooled, state.queue, results)
                continue
            if state.update(eco):
                reqs_to_abort.append(state.request_id)
            finished = state.finish_reason is not None
            if not finished and state.parent is None and state.output_kind == FINAL_ONLY:
                continue  # (nothing to send before the end)
            if finished:
                del self.request_states[state.request_id]

            if state.parent is not None:
                p = state.parent
                if finished:
                    p.finished_indices.add(state.index)
                if state.num_cached_tokens > p.num_cached_tokens:
                    p.num_cached_tokens = state.num_cached_tokens
                # Prompt logprobs: taken from the first child that produces them.
                if state.prompt_logprobs and p.prompt_logprobs_owner is None:
                    p.prompt_logprobs_owner = state.index
                    p.prompt_logprobs = state.prompt_logprobs  # shared, grows in place
                if eco.new_token_ids and "first_token_time" not in p.metrics:
                    p.metrics["first_token_time"] = state.first_token_time
                if eco.new_token_ids or finished:
                    parent_updates.setdefault(p.request_id, []).append(state)
                continue

            if not finished and (not eco.new_token_ids or state.output_kind == FINAL_ONLY):
                continue  # e.g. a prefill chunk that only carried prompt logprobs
            co = state.make_completion_output()
            if co is None:
                continue
            out = RequestOutput(
                request_id=state.request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                prompt_logprobs=state.take_prompt_logprobs(state.output_kind),
                outputs=[co],
                finished=finished,
                num_cached_tokens=state.num_cached_tokens,
                metrics=state.metrics(),
            )
            self._deliver(out, state.queue, results)

        for pid, updates in parent_updates.items():
            parent = updates[0].parent
            assert parent is not None, "parent_updates holds children of n > 1 requests only"
            parent_out = self._make_parent_output(parent, updates)
            if parent.finished:
                self.parent_requests.pop(pid, None)
            if parent_out is not None:
                self._deliver(parent_out, parent.queue, results)
        return results, reqs_to_abort

    @staticmethod
    def _deliver(out: Any, queue: Any, results: list[Any]) -> None:
        if queue is not None:
            queue.put_nowait(out)
        else:
            results.append(out)

    def _make_parent_output(
        self, p: ParentRequest, updates: list[RequestState]
    ) -> Optional[RequestOutput]:
        kind = p.output_kind
        changed: list[CompletionOutput] = []
        for state in updates:
            if kind == DELTA:
                co = state.make_completion_output()
                if co is not None:
                    changed.append(co)
            elif kind == CUMULATIVE or state.finish_reason is not None:
                # Cumulative snapshot per child (FINAL_ONLY: only the final one).
                p.latest[state.index] = state.make_completion_output(force_cumulative=True)
        finished = p.finished
        if kind == FINAL_ONLY and not finished:
            return None
        if kind == DELTA:
            if not changed:
                return None
            outputs = sorted(changed, key=lambda c: c.index)
            if p.prompt_logprobs is not None and p.prompt_logprobs_sent < len(p.prompt_logprobs):
                prompt_lps = p.prompt_logprobs[p.prompt_logprobs_sent:]
                p.prompt_logprobs_sent = len(p.prompt_logprobs)
            else:
                prompt_lps = None
        else:
            outputs = [p.latest.get(i) or CompletionOutput(index=i, text="", token_ids=[])
                       for i in range(p.n)]
            prompt_lps = list(p.prompt_logprobs) if p.prompt_logprobs is not None else None
        if prompt_lps is None and getattr(p.sampling_params, "prompt_logprobs", None) is not None \
                and kind != DELTA:
            prompt_lps = []
        metrics = dict(p.metrics)
        if finished:
            metrics["finished_time"] = time.time()
        return RequestOutput(
            request_id=p.request_id,
            prompt=p.prompt,
            prompt_token_ids=p.prompt_token_ids,
            prompt_logprobs=prompt_lps,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=p.num_cached_tokens,
            metrics=metrics,
        )
