"""Executors: own an engine replica's workers; the only thing ``EngineCore`` talks to.

``Executor.get_class(args)`` picks the backend from ``distributed_executor_backend``:
"uni" (``UniProcExecutor``: one in-process worker, no IPC), "mp" (``MultiprocExecutor``: one
spawned process per rank) or "ray" (``RayExecutor``: one Ray actor per rank).
"""
from pagedllm.executor.abstract import Executor, ExecutorDeadError

__all__ = ["Executor", "ExecutorDeadError"]
