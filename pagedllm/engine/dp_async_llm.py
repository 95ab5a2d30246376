"""Data parallelism behind one server: ``data_parallel_size`` independent engine replicas.

Each replica is a full ``AsyncLLM`` (its own scheduler, KV cache and executor, which may itself
use tensor/pipeline parallelism); a replica of one rank runs its worker in its own process
(the "mp" executor) so the replicas' model steps run in parallel, not on one interpreter.
``DPAsyncLLM`` has ``AsyncLLM``'s interface and routes each request to the least-loaded replica:
fewest requests in flight (dispatched here and not finished), then lowest KV cache usage, then
lowest index (vLLM's DP load balancing uses the same two signals: queue lengths and KV usage).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, AsyncIterator, Optional

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError

logger = logging.getLogger("pagedllm")


class _ReplicaRecorder:
    """Stat logger installed in replica ``index``: forwards its records to the DP engine's
    loggers (``record_replica`` where a logger keeps replicas apart, else ``record``)."""

    def __init__(self, dp: "DPAsyncLLM", index: int) -> None:
        self.dp, self.index = dp, index

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        for lg in list(self.dp.stat_loggers):
            per = getattr(lg, "record_replica", None)
            if per is not None:
                per(self.index, scheduler_stats, iteration_stats)
            else:
                lg.record(scheduler_stats, iteration_stats)


class DPAsyncLLM:
    """``data_parallel_size`` ``AsyncLLM`` replicas with one front door.

    Args:
        args: EngineArgs with ``data_parallel_size > 1``.

    Raises:
        ValueError: what a replica's construction raised (every replica started is shut down).
    """

    def __init__(self, args: EngineArgs) -> None:
        n = int(args.data_parallel_size)
        if n < 2:
            raise ValueError(f"data_parallel_size: DPAsyncLLM needs >= 2 replicas, got {n}")
        backend = args.distributed_executor_backend or "mp"
        self.args = args
        self.stat_loggers: list[Any] = []
        # NOTE: every entry is set once the loop below has built them all (shutdown() skips the
        # None entries of a failed build); typed as built.
        self.replicas: list[AsyncLLM] = [None] * n  # type: ignore[list-item]
        errors: list[BaseException] = []

        def build(i: int) -> None:
            try:
                rargs = dataclasses.replace(args, distributed_executor_backend=backend, data_parallel_rank=i)
                self.replicas[i] = AsyncLLM(rargs)
            except BaseException as e:  # reported below, after every build has ended
                errors.append(e)

        # NOTE: one after the other: building them on threads raced in transformers' lazy
        # imports ("cannot import name 'AutoConfig'") in the engine threads.
        for i in range(n):
            build(i)
            if errors:
                break
        if errors:
            self.shutdown()
            raise errors[0]
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.max_model_len = min(r.max_model_len for r in self.replicas)
        # NOTE: the replicas are built from one EngineArgs: one front end checks for all of them
        # (the smallest max_model_len, should a replica's KV cache hold fewer tokens).
        self.input_processor = min((r.input_processor for r in self.replicas), key=lambda p: p.max_model_len)
        # the replica with the smallest context: its max_model_len is the server's (vLLM's model_config)
        self.model_config = min((r.model_config for r in self.replicas), key=lambda c: c.max_model_len)
        self.vocab_size = first.vocab_size
        self.model_name = first.model_name
        self.runner = first.runner
        self.pooler = first.pooler
        self.default_sampling_params = dict(first.default_sampling_params)
        self.kv_capacity_tokens = sum(r.kv_capacity_tokens for r in self.replicas)
        self.enable_lora = first.enable_lora
        self.kv_transfer_config = first.kv_transfer_config
        self.engine = first.engine  # NOTE: front-end helpers (tokenizer, chat template) are identical
        self._inflight = [0] * n
        self._where: dict[str, int] = {}
        for i, r in enumerate(self.replicas):
            r.stat_loggers.append(_ReplicaRecorder(self, i))
        self.requests_routed = [0] * n

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "DPAsyncLLM":
        return cls(args)

    # ------------------------------------------------------------------ routing
    def _pick(self) -> int:
        """The least-loaded replica: fewest requests in flight, then lowest KV cache usage."""
        best, best_key = 0, None
        for i, r in enumerate(self.replicas):
            key = (self._inflight[i], r.get_scheduler_stats().get("kv_cache_usage", 0.0), i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _route(self, request_id: str) -> int:
        if request_id in self._where:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        i = self._pick()
        self._where[request_id] = i
        self._inflight[i] += 1
        self.requests_routed[i] += 1
        return i

    def _release(self, request_id: str, i: int) -> None:
        if self._where.pop(request_id, None) is not None:
            self._inflight[i] -= 1

    # ------------------------------------------------------------------ API (AsyncLLM's)
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       add_special_tokens: bool = True, lora_request: Any = None) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` on the least-loaded replica (``prompt``: an EngineCoreRequest,
        or a prompt that replica processes)."""
        i = self._route(request_id)
        try:
            async for out in self.replicas[i].generate(prompt, sampling_params, request_id,
                                                       add_special_tokens=add_special_tokens,
                                                       lora_request=lora_request):
                yield out
        finally:
            self._release(request_id, i)

    async def encode(self, prompt: Any, pooling_params: Any, request_id: str, *, task: Optional[str] = None,
                     add_special_tokens: bool = True, lora_request: Any = None) -> Any:
        """``AsyncLLM.encode`` on the least-loaded replica."""
        i = self._route(request_id)
        try:
            return await self.replicas[i].encode(prompt, pooling_params, request_id, task=task,
                                                 add_special_tokens=add_special_tokens, lora_request=lora_request)
        finally:
            self._release(request_id, i)

    async def abort(self, request_id: str) -> None:
        i = self._where.get(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter on every replica (True when one read it from disk)."""
        loaded = False
        for r in self.replicas:
            loaded = (await r.add_lora(lora_request)) or loaded
        return loaded

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter from every replica (True when one held it)."""
        held = False
        for r in self.replicas:
            held = (await r.remove_lora(lora_int_id)) or held
        return held

    async def list_loras(self) -> set[int]:
        """Ids of the adapters loaded on the first replica."""
        return await self.replicas[0].list_loras()

    async def reset_prefix_cache(self) -> bool:
        ok = True
        for r in self.replicas:
            ok = (await r.reset_prefix_cache()) and ok
        return ok

    def get_scheduler_stats(self) -> dict[str, Any]:
        """Totals over the replicas (KV usage: the mean); ``per_replica`` lists each one's."""
        per = [r.get_scheduler_stats() for r in self.replicas]
        out: dict[str, Any] = {k: sum(s.get(k, 0) for s in per) for k in
                     ("num_running", "num_waiting", "num_preemptions_total", "prefix_cache_queries",
                      "prefix_cache_hits")}
        out["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in per) / len(per)
        if "lora_running_adapters" in per[0]:
            for k in ("max_loras", "max_cpu_loras", "lora_cpu_cache_adapters"):  # NOTE: every replica loads the same
                out[k] = per[0].get(k, 0)
            for k in ("lora_running_adapters", "lora_waiting_adapters"):
                out[k] = sorted({name for st in per for name in st.get(k, ())})
        out["per_replica"] = per
        return out

    def get_memory_stats(self) -> dict[str, Any]:
        """Memory in bytes: this process (where every replica's engine runs) plus each
        replica's worker processes; the caching allocator is the process's one."""
        out = self.replicas[0].get_memory_stats()
        for r in self.replicas[1:]:
            out["resident_memory_bytes"] += r.engine.core.executor.get_memory_stats().get("resident_memory_bytes", 0)
        return out

    def get_kv_events_stats(self) -> dict[str, Any]:
        """The replicas' KV event publishers' counters, summed ({} when events are off); each
        replica publishes on its own endpoint (the port offset by its rank)."""
        out: dict[str, Any] = {}
        for r in self.replicas:
            for k, v in r.get_kv_events_stats().items():
                out[k] = out.get(k, 0) + v
        return out

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` naming the first unhealthy replica (and its rank)."""
        for i, r in enumerate(self.replicas):
            try:
                await r.check_health()
            except Exception as e:
                raise EngineDeadError(f"data-parallel replica {i}: {e}") from None

    def make_prometheus_logger(self, model_name: str, max_model_len: int, prefix: str = "pagedllm") -> Any:
        """The server's Prometheus logger: one series per replica (label ``engine``)."""
        from pagedllm.metrics.replicas import ReplicaPrometheusLogger
        return ReplicaPrometheusLogger(model_name, max_model_len, len(self.replicas), self.replicas, prefix)

    def shutdown(self) -> None:
        """Shut every replica down (their worker processes too)."""
        for r in self.replicas:
            if r is not None:
                try:
                    r.shutdown()
                except Exception:
                    logger.exception("replica shutdown failed")
