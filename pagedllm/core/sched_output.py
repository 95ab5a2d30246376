"""What the scheduler hands the model runner each step (pure Python, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in this step.

    Attributes:
        req_id: request id.
        token_ids: the request's whole token list (prompt + output), by reference
            (no copy); the runner computes ``token_ids[start_pos : start_pos + num_tokens]``.
        start_pos: ``num_computed_tokens`` before this step (position of the first new token).
        num_tokens: tokens to compute this step (>= 1); 1 for a decode.
        block_ids: the request's whole block table (list[int]) after this step's allocation.
        is_last_chunk: True when ``start_pos + num_tokens == len(token_ids)``, i.e. this step
            produces the next token (generation) or finishes the prompt (pooling).
        sampling_params: the request's SamplingParams, or None for pooling.
        pooling_params: the request's PoolingParams, or None for generation.
        prompt_len: number of prompt tokens (so ``token_ids[:prompt_len]`` is the prompt).
        is_new: True the first step after (re)admission: the runner drops any old state.
        spec_token_ids: draft tokens scheduled for verification after ``token_ids`` (counted in
            ``num_tokens``: the step computes ``token_ids[start_pos:] + spec_token_ids``); empty
            when not speculating.
        lora_request: the request's LoRA adapter (a ``LoRARequest``) or None.
        prompt_embeds: the prompt's embeddings (a ``[prompt_len, hidden]`` tensor in the model
            dtype, by reference) for a prompt given as embeddings, else None: the runner feeds
            rows ``start_pos .. min(start_pos + num_tokens, prompt_len)`` instead of looking up
            ``token_ids`` (placeholders there).
        mm_features: the request's ``pagedllm.multimodal.MultiModalFeature`` list (by reference)
            while its prompt is being computed, else None: the runner feeds the encoder outputs of
            the placeholder rows this chunk covers.
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    num_tokens: int
    block_ids: list[int]
    is_last_chunk: bool
    sampling_params: Any = None
    pooling_params: Any = None
    prompt_len: int = 0
    is_new: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None
    prompt_embeds: Any = None
    mm_features: Any = None


@dataclass
class SchedulerOutput:
    """The step's batch.

    Two forms of the same batch. The general one is ``scheduled``, one :class:`ScheduledRequest`
    per request. A step whose every request is an *unchanged decode* (running before this step,
    one new token, no drafts, no grammar, past its prompt, a generation request) may instead come
    in the flat form of vLLM v1's ``CachedRequestData``: ``cached_req_ids`` /
    ``cached_start_pos`` / ``cached_token_ids`` (one entry per request, batch order) and
    ``cached_new_block_ids`` for the few whose block table grew; the model runner's persistent
    ``InputBatch`` already holds everything else (parameters, block tables). Reading
    ``scheduled`` of a flat step builds the ``ScheduledRequest`` list once (the same objects
    the general form would hold), so every consumer that reads it works on both forms; the
    hot path (the in-process runner, ``Scheduler.update_from_output``) reads the flat lists.

    Attributes:
        scheduled: requests in batch order (the runner may reorder decodes first).
        total_num_scheduled_tokens: sum of ``num_tokens`` over ``scheduled`` (<= token budget).
        finished_req_ids: ids finished or aborted since the last step (runner frees their state).
        preempted_req_ids: ids preempted in this step (their blocks were freed).
        structured_output_request_ids: req_id -> row of ``grammar_bitmask``, for the requests
            with a grammar that sample a token this step (``is_last_chunk``).
        grammar_bitmask: int32 ``[len(structured_output_request_ids), ceil(vocab / 32)]`` (a
            torch tensor on the CPU; bit j of word w set = token 32w+j allowed), filled by the
            engine core after ``schedule()``; None when no row is constrained.
        kv_connector_metadata: the KV connector's ``KVConnectorMetadata`` for the step (loads and
            saves the worker-side connector does around the forward); None without a connector.
        cached_req_ids: flat form only: the requests' ids, batch order (else empty).
        cached_start_pos: flat form: each request's ``num_computed_tokens`` before the step (the
            position of its one new token).
        cached_token_ids: flat form: each request's input token (``token_ids[start_pos]``, the
            token sampled last step).
        cached_new_block_ids: flat form: req_id -> its whole block table (a copy), only for the
            requests whose table grew in this step's allocation.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    kv_connector_metadata: Any = None
    cached_req_ids: list[str] = field(default_factory=list)
    cached_start_pos: list[int] = field(default_factory=list)
    cached_token_ids: list[int] = field(default_factory=list)
    cached_new_block_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.cached_req_ids and not self.scheduled

    @property
    def is_flat(self) -> bool:
        """True when the step is in the flat form and ``scheduled`` has not been built yet."""
        return self.__dict__["_scheduled"] is None

    @property
    def num_reqs(self) -> int:
        """Number of scheduled requests (either form; builds nothing)."""
        return len(self.cached_req_ids) if self.__dict__["_scheduled"] is None else len(self.scheduled)

    def set_flat(self, sources: list[tuple[Any, list[int], int]]) -> None:
        """Switch to the flat form (``Scheduler.schedule``): ``sources`` holds, per request in
        batch order, ``(Request, its block id list (by reference), its length in this step)``,
        from which ``scheduled`` is built if something reads it. Block lists only grow while a
        request holds them (``KVCacheManager``), so the prefix is this step's table."""
        self.__dict__["_scheduled"] = None
        self.__dict__["_flat_sources"] = sources

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_scheduled"] = self.scheduled  # (builds it: Request objects do not travel)
        d.pop("_flat_sources", None)
        return d


def _get_scheduled(self: SchedulerOutput) -> list[ScheduledRequest]:
    got: Optional[list[ScheduledRequest]] = self.__dict__["_scheduled"]
    if got is None:
        got = []
        for (req, blocks, nb), start in zip(self.__dict__.pop("_flat_sources"), self.cached_start_pos):
            got.append(ScheduledRequest(
                req.request_id, req.all_token_ids, start, 1, blocks[:nb], True, req.sampling_params, None,
                len(req.prompt_token_ids), False, _NO_SPEC, req.lora_request, None, None))
        self.__dict__["_scheduled"] = got
    return got


def _set_scheduled(self: SchedulerOutput, value: list[ScheduledRequest]) -> None:
    self.__dict__["_scheduled"] = value
    self.__dict__.pop("_flat_sources", None)


# ``ScheduledRequest.spec_token_ids`` of a request without drafts: one shared, never mutated empty list.
_NO_SPEC: list[int] = []

# NOTE: after @dataclass (which set the field's default from the class attribute): ``scheduled``
# becomes a property over ``__dict__["_scheduled"]`` (None while only the flat form exists).
SchedulerOutput.scheduled = property(_get_scheduled, _set_scheduled)  # type: ignore[assignment]


@dataclass
class ModelRunnerOutput:
    """What the runner returns for a step.

    Attributes:
        sampled_token_ids: req_id -> list of new token ids (empty list or absent for a
            request whose chunk did not reach the end of its tokens).
        logprobs: req_id -> per new token, a tuple ``(token_ids: list[int], logprobs:
            list[float], sampled_rank: int)``; the sampled token first, then the top-k.
        prompt_logprobs: req_id -> list (one per prompt position computed this step) of the
            same tuple shape, or None entries.
        pooler_output: req_id -> pooled tensor (float32, on CPU) for finished pooling requests.
        spec_token_ids: req_id -> draft tokens proposed for the request's next step
            (speculative decoding; absent when none).
        kv_connector_output: what the worker-side KV connector reports for the step
            (``KVConnectorBase_V1.get_connector_output``), or None.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Any]] = field(default_factory=dict)
    pooler_output: dict[str, Any] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_output: Any = None


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news after a step (consumed by the output processor).

    Attributes:
        req_id: request id.
        new_token_ids: tokens appended this step.
        new_logprobs: per new token the runner's logprobs tuple, or None.
        new_prompt_logprobs: prompt logprobs produced this step, or None.
        finish_reason: "stop", "length", "abort" or None while running.
        stop_reason: stopping token id (int) or None (stop strings are the output
            processor's business).
        pooled: pooled tensor for a finished pooling request.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    req_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[Any]] = None
    new_prompt_logprobs: Optional[list[Any]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    pooled: Any = None
    num_cached_tokens: int = 0
