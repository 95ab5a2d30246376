"""``EngineCoreRequest``: one validated request, the boundary between the front end and the core.

``InputProcessor.process_inputs`` builds it (every check done there, once); ``LLMEngine`` and
``AsyncLLM`` accept it (``add_request``, ``generate``, ``encode``), so the offline ``LLM`` and the
HTTP server hand the engine the same thing (vLLM v1's ``EngineCoreRequest``). Pure Python.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class EngineCoreRequest:
    """A request that passed every front-end check.

    Attributes:
        request_id: the user-facing id (``n > 1`` requests fan out into ``f"{i}_{id}"`` children).
        prompt_token_ids: the token ids the engine computes (after truncation), each in
            ``[0, vocab_size)``; ``1 <= len <= max_model_len``.
        sampling_params: a ``SamplingParams`` clone with ``max_tokens`` filled, for generation;
            None for pooling.
        pooling_params: a ``PoolingParams`` clone verified for its ``task`` (the PoolerConfig
            defaults filled in), for pooling; None for generation.
        eos_token_id: the tokenizer's EOS id (int) or None.
        arrival_time: ``time.time()`` seconds when the request arrived.
        prompt: the prompt text (None for a prompt given as token ids only); after truncation,
            the text of the kept ids.
        cache_salt: optional non-empty string mixed into the first prefix-cache block hash.
        lora_request: the LoRA adapter to apply (None = the base model).
        priority: scheduling priority (lower runs first; nonzero only under
            ``scheduling_policy="priority"``).
        trace_headers: the W3C trace-context headers (``traceparent``, ``tracestate``) of the
            HTTP request, the parent of the request's span when tracing is on; None otherwise.
        prompt_embeds: for a prompt given as embeddings, the ``[len(prompt_token_ids), hidden]``
            tensor in the model dtype (``prompt_token_ids`` are placeholder zeros then), else None.
        prompt_embeds_hash: sha256 hex digest of ``prompt_embeds`` (prefix-cache key), or None.
        mm_features: the prompt's images (``pagedllm.multimodal.MultiModalFeature`` list) or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[Any] = None
    pooling_params: Optional[Any] = None
    eos_token_id: Optional[int] = None
    arrival_time: float = field(default_factory=time.time)
    prompt: Optional[str] = None
    cache_salt: Optional[str] = None
    lora_request: Optional[Any] = None
    priority: int = 0
    trace_headers: Optional[dict[str, str]] = None
    prompt_embeds: Optional[Any] = None
    prompt_embeds_hash: Optional[str] = None
    mm_features: Optional[list[Any]] = None

    @property
    def params(self) -> Any:
        """The request's SamplingParams or PoolingParams."""
        return self.sampling_params if self.sampling_params is not None else self.pooling_params

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def structured_outputs(self) -> Any:
        """The ``StructuredOutputsParams`` of a constrained generation request, else None."""
        return getattr(self.sampling_params, "structured_outputs", None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
