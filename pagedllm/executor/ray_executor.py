"""One Ray actor per rank (``distributed_executor_backend="ray"``), placed with a placement group;
works on a multi-node Ray cluster (``ray start --head`` / ``ray start --address``).

Connects to the running cluster (``RAY_ADDRESS``, or the one ``ray start`` left on this machine)
or starts a local Ray instance. Each rank needs ``num_threads`` (default 1) CPUs, or one GPU on
CUDA. ``torch.distributed`` rendezvous on rank 0's node IP and a port it picked. A step is
encoded once (``SchedulerOutputEncoder``), put in Ray's object store once and passed to every
actor; the engine waits on all the actors' results until the output rank's arrives, so an
error or a dead actor on any rank is reported (naming the rank) instead of waiting on a
collective that will never finish.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Union

from pagedllm.config import EngineArgs
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.executor.sched_codec import SchedulerOutputDecoder, SchedulerOutputEncoder
from pagedllm import envs

logger = logging.getLogger("pagedllm")

_ENV_PREFIXES = ("PAGEDLLM_", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_", "PYTHONPATH")


class RayWorkerWrapper:
    """The actor body: a ``Worker`` and the step decoder (created remotely by ``RayExecutor``)."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.decoder = SchedulerOutputDecoder()

    def node_ip_and_port(self) -> tuple[str, int]:
        import socket

        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, args: EngineArgs, rank: int, init_method: str, local_world_size: int) -> None:
        from pagedllm.worker.worker import Worker
        self.worker = Worker(args, rank=rank, distributed_init_method=init_method,
                             local_world_size=local_world_size, load_tokenizer=False)

    def rpc(self, method: Union[str, Callable], args: tuple, kwargs: dict) -> Any:
        fn = getattr(self.worker, method) if isinstance(method, str) else (
            lambda *a, **k: method(self.worker, *a, **k))
        out = fn(*args, **kwargs)
        return None if method == "load_model" else out  # NOTE: the LoadedModel is not picklable

    def execute(self, payload: tuple) -> Optional[ModelRunnerOutput]:
        return self.worker.execute_model(self.decoder.decode(payload))

    def ping(self) -> bool:
        return True


class _RayStep:
    """A step in flight: ``result()`` waits for the output rank's result, watching every rank."""

    def __init__(self, executor: "RayExecutor", refs: list) -> None:
        self.executor, self.refs, self.sent_at = executor, refs, time.monotonic()

    def result(self) -> ModelRunnerOutput:
        return self.executor._wait_step(self)


class RayExecutor(Executor):
    """``tensor_parallel_size x pipeline_parallel_size`` Ray actors."""

    def _init_executor(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        args, n = self.args, self.world_size
        loaded = self._load_model_info_first()
        self.output_rank = (args.pipeline_parallel_size - 1) * args.tensor_parallel_size
        self._encoder = SchedulerOutputEncoder()
        self._timeout = float(envs.get("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S"))
        self._failure: Optional[str] = None
        self._closed = False
        self.actors: list[Any] = []
        self.pg = None
        self._started_ray = False
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            extra = {} if address else {
                # NOTE: only for an instance started here: a small object store (steps are KBs)
                "object_store_memory": int(envs.get("PAGEDLLM_RAY_OBJECT_STORE_BYTES"))}
            ray.init(address=address, runtime_env={"env_vars": env}, include_dashboard=False,
                     log_to_driver=True, **extra)
            self._started_ray = True
        gpu = args.device == "cuda" or (args.device == "auto" and _cuda())
        cpus = float(args.num_threads or 1)
        bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
        try:
            self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
            ready_s = float(envs.get("PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S"))
            if not self.pg.wait(ready_s):
                raise ValueError(f"distributed_executor_backend='ray': the cluster cannot place {n} ranks of "
                                 f"{bundle} within {ready_s:.0f} s (resources: {ray.cluster_resources()})")
            cls = ray.remote(RayWorkerWrapper)
            for rank in range(n):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                            placement_group_bundle_index=rank)
                self.actors.append(cls.options(num_cpus=cpus, num_gpus=1 if gpu else 0,
                                               scheduling_strategy=strategy,
                                               runtime_env={"env_vars": env}).remote())
            ip, port = ray.get(self.actors[0].node_ip_and_port.remote())
            init_method = f"tcp://{ip}:{port}"
            nodes = ray.get([a.node_ip_and_port.remote() for a in self.actors])
            per_node = {}
            for node_ip, _ in nodes:
                per_node[node_ip] = per_node.get(node_ip, 0) + 1
            ray.get([a.setup.remote(args, r, init_method, per_node[nodes[r][0]]) for r, a in enumerate(self.actors)])
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
            import dataclasses
            infos = self.collective_rpc("model_info", kwargs={"with_loaded": False})
            self.model_info = dataclasses.replace(infos[self.output_rank], loaded=loaded)
            self.nodes = [ip_ for ip_, _ in nodes]
        except BaseException:
            self.shutdown()
            raise
        logger.info("pagedllm: %d Ray actors on nodes %s", n, self.nodes)

    def _get_all(self, refs: list, timeout: Optional[float], want: Optional[int] = None) -> dict[int, Any]:
        """Wait for ``refs`` (one per rank) until rank ``want``'s (or every) result is in; any
        rank's error or death raises (an RPC's own exception type is kept)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index = {ref: r for r, ref in enumerate(refs)}
        pending, got = list(refs), {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending and (want is None or want not in got):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                missing = [index[p] for p in pending]
                raise self._fail(f"worker rank(s) {missing} did not answer within {timeout:.0f} s")
            for ref in ready:
                rank = index[ref]
                try:
                    got[rank] = ray.get(ref)
                except RayTaskError as e:
                    cause = e.as_instanceof_cause()
                    dead = self._fail(f"worker rank {rank} failed: {type(cause).__name__}: {cause}")
                    if isinstance(cause, (ValueError, TypeError, NotImplementedError)):
                        raise cause from dead
                    raise dead from None
                except RayActorError as e:
                    raise self._fail(f"worker rank {rank} (Ray actor) died: {e}") from None
        return got

    def collective_rpc(self, method: Union[str, Callable], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        self._check_usable()
        refs = [a.rpc.remote(method, args, kwargs or {}) for a in self.actors]
        got = self._get_all(refs, timeout)
        return [got[r] for r in range(self.world_size)]

    def get_pooler(self) -> Any:
        return self.collective_rpc("get_pooler")[self.output_rank]

    def _check_usable(self) -> None:
        if self._closed:
            raise ExecutorDeadError("executor is shut down")
        if self._failure is not None:
            raise ExecutorDeadError(self._failure)

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        import ray

        if so.is_empty:
            self._encoder.defer(so)
            out = ModelRunnerOutput()
            if not non_block:
                return out
            from concurrent.futures import Future
            fut: Future = Future()
            fut.set_result(out)
            return fut
        self._check_usable()
        payload = ray.put(self._encoder.encode(so))
        step = _RayStep(self, [a.execute.remote(payload) for a in self.actors])
        return step if non_block else step.result()

    def _wait_step(self, step: _RayStep) -> ModelRunnerOutput:
        return self._get_all(step.refs, self._timeout, want=self.output_rank)[self.output_rank]

    def check_health(self) -> None:
        self._check_usable()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            import ray
        except ImportError:
            return
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False
