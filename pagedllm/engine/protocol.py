"""``EngineClient``: what the HTTP server needs from an engine (vLLM's name and role).

``AsyncLLM`` (one engine), ``DPAsyncLLM`` (data-parallel replicas) and the test fakes implement
it; the server is typed against it and never probes an engine for optional attributes. The
server builds each request with ``input_processor.process_inputs`` (the one input path, shared
with the offline ``LLM``) and hands the resulting ``EngineCoreRequest`` to ``generate`` /
``encode``.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Protocol, runtime_checkable

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.outputs import PoolingRequestOutput, RequestOutput


@runtime_checkable
class EngineClient(Protocol):
    """An engine the OpenAI server can serve.

    Attributes:
        tokenizer: the model's transformers tokenizer.
        input_processor: prompt -> EngineCoreRequest, with every input check.
        max_model_len: max prompt + output tokens.
        vocab_size: model vocabulary size.
        model_name: the model argument (the default served name).
        runner: "generate" or "pooling".
        pooler: the model's Pooler (``task``, ``label(i)``), None for a generation model.
        default_sampling_params: sampling defaults from the model's generation config (dict of
            SamplingParams field -> value).
        kv_capacity_tokens: tokens the KV cache holds (all replicas together).
        stat_loggers: objects with ``record(scheduler_stats, iteration_stats)``, called after
            every engine step (the server appends its loggers).
        enable_lora: LoRA adapters can be served (``EngineArgs.enable_lora``): ``add_lora`` /
            ``remove_lora`` / ``list_loras`` work and requests may carry a ``lora_request``.
        kv_transfer_config: the engine's ``--kv-transfer-config`` (``KVTransferConfig``) or None;
            a P2P producer's responses carry the ``kv_transfer_params`` it implies.
    """

    tokenizer: Any
    input_processor: InputProcessor
    max_model_len: int
    vocab_size: int
    model_name: str
    runner: str
    pooler: Optional[Any]
    default_sampling_params: dict[str, Any]
    kv_capacity_tokens: int
    stat_loggers: list[Any]
    enable_lora: bool
    kv_transfer_config: Optional[Any]

    def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                 add_special_tokens: bool = True, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Stream the RequestOutputs of one generation request (an async generator);
        ``lora_request`` (a ``LoRARequest``, for a prompt that is not an EngineCoreRequest,
        which carries its own) runs it with that adapter.

        Raises:
            ValueError: invalid input, LoRA not enabled or an adapter that cannot be loaded,
                before anything is yielded.
        """
        ...

    async def encode(self, prompt: Any, pooling_params: Any, request_id: str, *, task: Optional[str] = None,
                     add_special_tokens: bool = True, lora_request: Any = None) -> PoolingRequestOutput:
        """Run one pooling request (``lora_request``: as for ``generate``).

        Raises:
            ValueError: invalid input (nothing is run).
        """
        ...

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter (``LoRARequest``) on every worker; True when it was read from disk.

        Raises:
            ValueError: LoRA not enabled, or an adapter that cannot be loaded (the message names
                it; "No adapter found" when nothing is at its path).
        """
        ...

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter; True when it was loaded."""
        ...

    async def list_loras(self) -> set[int]:
        """Ids (``lora_int_id``) of the loaded LoRA adapters."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished)."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False when requests hold blocks."""
        ...

    def get_scheduler_stats(self) -> dict[str, Any]:
        """Totals: num_running, num_waiting, kv_cache_usage, num_preemptions_total,
        prefix_cache_queries, prefix_cache_hits (+ structured-output cache counters)."""
        ...

    def get_memory_stats(self) -> dict[str, Any]:
        """Memory in bytes: resident_memory_bytes (+ the CPU allocator's counters)."""
        ...

    def get_kv_events_stats(self) -> dict[str, Any]:
        """The KV cache event publisher's counters (``pagedllm.kv_events.KVEventPublisher.stats``:
        kv_events_queue_batches, kv_events_queue_capacity, kv_events_batches_published_total,
        kv_events_batches_dropped_total); {} without ``--kv-events-config``."""
        ...

    async def check_health(self) -> None:
        """Raises when the engine is dead."""
        ...

    def make_prometheus_logger(self, model_name: str, max_model_len: int, prefix: str = "pagedllm") -> Any:
        """The stat logger behind ``/metrics`` (``registry``, ``render()``, ``content_type``, ...)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine (idempotent)."""
        ...


def missing_members(engine: Any) -> list[str]:
    """Names of ``EngineClient`` members ``engine`` lacks (empty for a conforming engine)."""
    names = [n for n in EngineClient.__annotations__] + [
        n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")]
    return [n for n in names if not hasattr(engine, n)]
