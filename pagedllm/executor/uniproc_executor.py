"""One rank in this process: the worker is called directly (no IPC, no pickling)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor


class UniProcExecutor(Executor):
    """Runs the single ``Worker`` in-process (today's path; ``driver_worker`` is it)."""

    def _init_executor(self) -> None:
        from pagedllm.worker.worker import Worker

        self.driver_worker = Worker(self.args, rank=0)
        self.driver_worker.init_device()
        self.model_info = self.driver_worker.load_model()

    def collective_rpc(self, method: Union[str, Callable], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        fn = getattr(self.driver_worker, method) if isinstance(method, str) else (
            lambda *a, **k: method(self.driver_worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def get_pooler(self) -> Any:
        return self.driver_worker.pooler

    def get_memory_stats(self) -> dict:
        """The in-process worker's caching-allocator counters (its RSS is the caller's)."""
        from pagedllm.kernels.cpu_ops import cpu_allocator_stats

        a = cpu_allocator_stats() if self.driver_worker.device.type == "cpu" else {}
        out = {}
        if a:
            out = {"cpu_allocator_cached_bytes": a["cached_bytes"], "cpu_allocator_live_bytes": a["live_bytes"],
                   "cpu_allocator_cache_limit_bytes": a["max_cached_bytes"]}
        ctl = getattr(self.driver_worker, "thread_controller", None)
        if self.driver_worker.device.type == "cpu":
            import torch
            out["cpu_compute_threads"] = ctl.threads if ctl is not None else torch.get_num_threads()
        return out

    def execute_model(self, so: SchedulerOutput, non_block: bool = False
                      ) -> Union[ModelRunnerOutput, "Future[ModelRunnerOutput]"]:
        out = self.driver_worker.execute_model(so)
        if not non_block:
            return out
        fut: Future = Future()
        fut.set_result(out)
        return fut
