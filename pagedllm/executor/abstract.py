"""The executor interface (vLLM's names): ``initialize``, ``determine_available_memory``,
``execute_model``, ``collective_rpc``, ``check_health``, ``shutdown``."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

from pagedllm.config import EngineArgs
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

BACKENDS = ("uni", "mp", "ray")

logger = logging.getLogger("pagedllm")


class ExecutorDeadError(RuntimeError):
    """A rank died, hung or failed: the replica cannot run steps any more (the message names
    the rank)."""


class Executor:
    """Owns the workers of one engine replica (``tensor_parallel_size x pipeline_parallel_size``
    ranks) and runs calls on them.

    Subclasses implement ``_init_executor`` and ``collective_rpc``; the default
    ``execute_model`` broadcasts the step and returns the output rank's result.

    Attributes:
        args: EngineArgs.
        world_size: ranks in the replica.
        model_info: the output rank's ``ModelInfo`` with the in-process ``LoadedModel``.
        max_concurrent_batches: steps the engine may keep in flight (the pipeline depth).
    """

    #: the first failure's message; once set, every later call raises ``ExecutorDeadError`` with it
    _failure: Optional[str] = None

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.world_size = args.world_size
        self.model_info: Any = None
        self.is_failed = False
        self._init_executor()

    def _fail(self, msg: str) -> ExecutorDeadError:
        """Mark the replica failed (the first message is kept and logged once) and return the
        error to raise."""
        if self._failure is None:
            self._failure = msg
            logger.error("pagedllm: %s", msg)
        self.is_failed = True
        return ExecutorDeadError(self._failure)

    @staticmethod
    def get_class(args: EngineArgs) -> type["Executor"]:
        """The executor class for ``args.distributed_executor_backend`` (None: "uni" for one
        rank, else "mp").

        Raises:
            ValueError: an unknown backend, or "uni" with more than one rank.
        """
        backend = args.distributed_executor_backend
        if backend is None:
            backend = "uni" if args.world_size == 1 else "mp"
        if backend not in BACKENDS:
            raise ValueError(f"distributed_executor_backend: must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "uni":
            if args.world_size != 1:
                raise ValueError(
                    f"distributed_executor_backend: 'uni' runs one rank; tensor_parallel_size x "
                    f"pipeline_parallel_size = {args.world_size} needs 'mp' or 'ray'")
            from pagedllm.executor.uniproc_executor import UniProcExecutor
            return UniProcExecutor
        if backend == "mp":
            from pagedllm.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor
        from pagedllm.executor.ray_executor import RayExecutor
        return RayExecutor

    @property
    def max_concurrent_batches(self) -> int:
        return self.args.pipeline_parallel_size

    def _load_model_info_first(self) -> Any:
        """``load_model_info(args)`` (config and tokenizer, no weights), read in the engine process
        before any rank starts, and the checks every rank would fail the same way (a head split the
        tensor-parallel ranks cannot share): the error comes without spawning them.

        Raises:
            ValueError: ``tensor_parallel_size`` cannot split the model's attention heads.
        """
        from pagedllm.distributed.tensor_parallel import check_head_split
        from pagedllm.worker.worker import load_model_info

        loaded = load_model_info(self.args)
        check_head_split(loaded.hf_config, self.args.tensor_parallel_size)
        return loaded

    def _init_executor(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def collective_rpc(self, method: Union[str, Callable], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        """Call ``method`` (a ``Worker`` method name, or a function taking the worker first) on
        every rank; returns the results in rank order.

        Raises:
            ExecutorDeadError: a rank died or did not answer within ``timeout`` seconds.
            Exception: what a rank's call raised (re-raised here).
        """
        raise NotImplementedError  # pragma: no cover - abstract

    # ------------------------------------------------------------------ engine calls
    def determine_available_memory(self) -> list[int]:
        """Each rank's KV cache byte budget, in rank order."""
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list[Any]:
        """Each rank's ``KVCacheSpec``, in rank order."""
        return self.collective_rpc("get_kv_cache_spec")

    def initialize(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every rank and build the runners."""
        self.collective_rpc("initialize_cache", args=(num_blocks, max_model_len))

    def get_pooler(self) -> Any:
        """The pooler the front end validates pooling parameters with (None: generation model)."""
        return self.collective_rpc("get_pooler")[0]

    def execute_model(self, so: SchedulerOutput, non_block: bool = False
                      ) -> Union[ModelRunnerOutput, "Future[ModelRunnerOutput]"]:
        """Run one step on every rank; the output rank's ``ModelRunnerOutput`` (a Future of it
        with ``non_block``, for pipeline parallelism)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def get_memory_stats(self) -> dict:
        """Memory of the workers, in bytes, read without calling them (any thread may ask):
        ``resident_memory_bytes`` of worker processes on this machine other than the caller's
        (0 when the workers run in-process) and, for in-process workers, the caching CPU
        allocator's counters (``cpu_allocator_*``). The default knows nothing: ``{}``."""
        return {}

    def check_health(self) -> None:
        """Raises ``ExecutorDeadError`` naming the rank when a rank has died or hangs."""

    def shutdown(self) -> None:
        """Stop every process / actor this executor started (idempotent)."""
