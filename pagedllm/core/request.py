"""The engine core's view of one request: token ids and progress counters.

Pure Python (no torch). The scheduler's one equation: every request has
``num_tokens`` (prompt + output tokens) and ``num_computed_tokens`` (tokens whose
K/V are in the KV cache); each step lets the second catch up with the first.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Optional


class RequestStatus(enum.IntEnum):
    """Life cycle of a request inside the engine core."""

    # Waiting for its grammar to compile (structured outputs; vLLM's WAITING_FOR_FSM).
    # NOTE: below WAITING so that "finished" stays "above PREEMPTED".
    WAITING_FOR_FSM = -1
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything above PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        """OpenAI ``finish_reason`` for a finished status ("stop", "length", "abort")."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence scheduled by the engine core.

    Attributes:
        request_id: unique id (str).
        prompt_token_ids: prompt token ids (list[int], length >= 1).
        sampling_params: a ``SamplingParams`` for generation, or None for pooling.
        pooling_params: a ``PoolingParams`` for pooling requests, else None.
        eos_token_id: the tokenizer's EOS id (int) or None.
        output_token_ids: generated token ids so far.
        num_computed_tokens: tokens (prompt + output) whose K/V are in the cache.
        num_cached_tokens: prompt tokens found in the prefix cache at first admission
            (-1 until the request is first scheduled).
        cache_salt: optional string mixed into the first block hash (prefix-cache isolation).
        block_hashes: chained hashes of the request's full blocks (filled by the KV cache manager).
        spec_token_ids: draft tokens proposed for the next step (speculative decoding); not part
            of ``all_token_ids`` until verified, never hashed into the prefix cache.
        stop_reason: the token id that stopped the request (int), or None.
        arrival_time: ``time.time()`` seconds when the request reached the core.
        priority: lower value is served first (FCFS within the same value).
        structured_output_request: the request's grammar state (structured outputs) or None.
            The scheduler calls only ``is_ready()`` (compiled, or failed), ``error()`` (the
            compile error or None), ``accept_tokens(list[int]) -> bool`` and ``is_terminated()``
            (see ``pagedllm.structured_output.request``); the engine core sets it.
        lora_request: the request's LoRA adapter (``pagedllm.lora.LoRARequest``: ``lora_name``,
            ``lora_int_id``, ``lora_path``) or None; it stays with the request across
            preemptions, and its id is mixed into the first block hash (no KV sharing across
            adapters).
        prompt_embeds: the prompt as embeddings (a ``[len(prompt_token_ids), hidden]`` tensor;
            ``prompt_token_ids`` are placeholders then) or None.
        prompt_embeds_hash: a digest of ``prompt_embeds`` (hex str), mixed into the first block
            hash so an embeddings prompt shares KV blocks only with the same embeddings.
        mm_features: the prompt's images (``pagedllm.multimodal.MultiModalFeature``: content hash,
            placeholder ``offset``/``length``, processed pixels), or None; their hashes enter the
            hashes of the blocks their placeholders overlap.
        max_tokens / min_tokens / stop_token_ids / ignore_eos: the stop settings the scheduler
            checks every token, read once from ``sampling_params`` here (``stop_token_ids``
            as a frozenset, or None when empty); ``max_tokens`` 0 and the rest off for pooling.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any = None,
        pooling_params: Any = None,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        lora_request: Any = None,
        prompt_embeds: Any = None,
        prompt_embeds_hash: Optional[str] = None,
        mm_features: Optional[list[Any]] = None,
    ) -> None:
        self.request_id = request_id
        self.mm_features = mm_features or None
        self.prompt_embeds = prompt_embeds
        self.prompt_embeds_hash = prompt_embeds_hash
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.priority = priority
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[Any] = []
        self.spec_token_ids: list[int] = []
        self.stop_reason: Optional[int | str] = None
        self.first_scheduled_time: Optional[float] = None
        self.structured_output_request: Any = None
        # The HTTP request's W3C trace-context headers (tracing; set by the front end).
        self.trace_headers: Optional[dict[str, str]] = None
        if sampling_params is not None:
            self.max_tokens = sampling_params.max_tokens
        else:
            self.max_tokens = 0
        self.min_tokens: int = getattr(sampling_params, "min_tokens", 0) or 0
        stop_ids = getattr(sampling_params, "stop_token_ids", None)
        self.stop_token_ids: Optional[frozenset[int]] = frozenset(stop_ids) if stop_ids else None
        self.ignore_eos: bool = bool(getattr(sampling_params, "ignore_eos", False))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens (the target ``num_computed_tokens`` chases)."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Prompt + output + draft tokens: what ``num_computed_tokens`` chases when speculating."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[str]:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, computed={self.num_computed_tokens})")
