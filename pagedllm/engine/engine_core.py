"""The engine core: the scheduler, the KV block tables and the step loop, over an executor.

``step()`` = ``scheduler.schedule()`` -> ``executor.execute_model()`` -> ``scheduler.update_from_output()``.
The executor (``pagedllm.executor``) owns the workers that load the model and hold the KV cache;
this module never touches a model, a loader or a kernel.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Optional

from pagedllm.config import EngineArgs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.metrics.memory import format_bytes as _fmt_bytes

logger = logging.getLogger("pagedllm")


class EngineCore:
    """Owns the scheduler and KV cache manager, and the executor that runs the model.

    Args:
        args: EngineArgs.

    Raises:
        ValueError: unknown model / bad settings, or a ``max_model_len`` that the KV cache
            cannot hold (the message says what would fit).
    """

    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.core.kv_cache_manager import KVCacheManager
        from pagedllm.core.scheduler import Scheduler
        from pagedllm.executor import Executor

        t0 = time.perf_counter()
        self.args = args
        if args.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {args.block_size}")
        if args.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {args.max_num_seqs}")
        if args.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {args.max_num_batched_tokens}")
        from pagedllm.core.scheduler import SCHEDULING_POLICIES
        if args.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {list(SCHEDULING_POLICIES)}, "
                             f"got {args.scheduling_policy!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if int(getattr(args, name)) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
        if args.max_model_len is not None and int(args.max_model_len) < 1:
            raise ValueError(f"max_model_len: must be >= 1 or 'auto', got {args.max_model_len}")
        from pagedllm.platforms import resolve_device
        # NOTE: before any weight is read: a KV budget of 0 or larger than RAM fails here.
        args.check_memory_args(resolve_device(args.device).type)
        from pagedllm.spec_decode.config import SpeculativeConfig
        self.spec_config = SpeculativeConfig.from_any(args.speculative_config)
        if self.spec_config is not None:
            if args.runner != "generate":
                raise ValueError("speculative_config: only for runner='generate'")
            if args.pipeline_parallel_size > 1:
                # NOTE: a step's drafts come from the previous step's output, which pipelined
                # steps in flight do not have yet.
                raise ValueError("speculative_config: not supported with pipeline_parallel_size > 1")
        if args.enable_lora:
            args.lora_limits()  # NOTE: bad limits fail before any worker starts
        from pagedllm.kv_events import KVEventsConfig
        kv_events_cfg = KVEventsConfig.from_any(args.kv_events_config)
        if kv_events_cfg is not None and kv_events_cfg.enable_kv_cache_events and kv_events_cfg.publisher == "zmq":
            try:
                import msgspec  # noqa: F401
                import zmq  # noqa: F401
            except ImportError as e:
                raise ValueError(f"kv_events_config: publisher 'zmq' needs the pyzmq and msgspec packages "
                                 f"(pip install pyzmq msgspec, or pip install 'pagedllm[kv-events]'): {e}") from None
        self.kv_transfer_config = self._check_kv_transfer_config(args)
        executor_cls = Executor.get_class(args)
        if args.enable_prompt_embeds:
            if args.runner != "generate":
                raise ValueError("enable_prompt_embeds: only for runner='generate'")
            if executor_cls.__name__ != "UniProcExecutor":
                # NOTE: the embeddings ride on the SchedulerOutput by reference (no codec for them).
                raise ValueError("enable_prompt_embeds: needs the in-process worker (tensor_parallel_size=1, "
                                 "pipeline_parallel_size=1, distributed_executor_backend='uni')")
        self.executor = executor_cls(args)
        try:
            self._init_cache(args, t0)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_connector = None
        hash_seed = None
        if self.kv_transfer_config is not None:
            try:
                self.kv_connector, hash_seed = self._init_kv_connector(args)
            except BaseException:
                self.executor.shutdown()
                raise
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.num_blocks, block_size=args.block_size,
            enable_caching=args.enable_prefix_caching,
            hash_algo=args.prefix_caching_hash_algo, hash_seed=hash_seed, max_model_len=self.max_model_len,
            max_free_cached_blocks=self.kv_prefix_keep_blocks)
        # KV cache events (--kv-events-config): the block pool records, step() publishes.
        # NOTE: the config is checked before the model loads (below only the sockets open).
        self.kv_events = None
        if kv_events_cfg is not None and kv_events_cfg.enable_kv_cache_events:
            if not args.enable_prefix_caching:
                logger.warning("pagedllm: kv_events_config: prefix caching is off, so no block is ever "
                               "stored and no KV cache event is published")
            from pagedllm.kv_events import KVEventPublisher
            try:
                self.kv_events = KVEventPublisher(kv_events_cfg, args.data_parallel_rank)
            except BaseException:
                self.executor.shutdown()
                raise
            self.kv_cache_manager.block_pool.enable_kv_events(args.block_size)
        sc = self.spec_config
        so_cfg = None
        if args.runner == "generate":
            from pagedllm.structured_output.config import StructuredOutputsConfig
            so_cfg = StructuredOutputsConfig.from_any(args.structured_outputs_config)
        self.scheduler = Scheduler(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len, kv_cache_manager=self.kv_cache_manager,
            num_spec_tokens=(sc.num_speculative_tokens or 0) if sc else 0,
            num_lookahead_tokens=sc.num_lookahead_tokens if sc else 0,
            max_loras=args.max_loras if args.enable_lora else 0,
            policy=args.scheduling_policy, connector=self.kv_connector,
            jump_forward_max_tokens=so_cfg.jump_forward_max_tokens if so_cfg and so_cfg.jump_forward else 0,
            jump_forward_disable_batch_size=so_cfg.jump_forward_disable_batch_size if so_cfg else 0)
        # LoRA: the adapters in the workers' CPU caches, least recently used first (add_lora).
        self.loras: "OrderedDict[int, Any]" = OrderedDict()
        self.max_cpu_loras = args.lora_limits()[2] if args.enable_lora else 0
        self.structured_output_manager = None
        if args.runner == "generate":
            from pagedllm.structured_output.manager import StructuredOutputManager
            # NOTE: cheap; a backend (tokenizer scan) is built on first use, off this thread.
            self.structured_output_manager = StructuredOutputManager(
                self.tokenizer, self.vocab_size, self.eos_token_id, so_cfg)
        # Steps in flight (pipeline parallelism): (SchedulerOutput, Future of its output).
        self.batch_queue_size = self.executor.max_concurrent_batches
        self._batch_queue: deque[tuple[Any, Any]] = deque()
        # Sleep mode: the tags asleep ("weights", "kv_cache") and the level they went to sleep at.
        self.sleeping_tags: set[str] = set()
        self.sleep_level = 0
        self.sleep_backup_bytes = 0  # the level-1 copy of the weights (temporary files), all ranks

    @staticmethod
    def _check_kv_transfer_config(args: EngineArgs) -> Any:
        """The ``KVTransferConfig`` from ``kv_transfer_config`` / ``kv_offloading_size`` /
        ``kv_cache_dir`` (None: no connector), checked before any worker starts.

        Raises:
            ValueError: a bad config, or one this engine cannot run (several ranks, pipelined
                steps, a draft-model proposer, prefix caching off, a pooling runner).
        """
        from pagedllm.distributed.kv_transfer.config import resolve_kv_transfer_config
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

        cfg = resolve_kv_transfer_config(args.kv_transfer_config, args.kv_offloading_size,
                                         args.kv_offloading_backend, args.kv_cache_dir, args.kv_cache_dir_size)
        if cfg is None:
            return None
        KVConnectorFactory.get_connector_class(cfg)  # NOTE: an unknown name fails here
        if args.world_size > 1 or args.distributed_executor_backend not in (None, "uni"):
            raise ValueError("kv_transfer_config: KV connectors run with one in-process rank "
                             "(tensor_parallel_size = pipeline_parallel_size = 1, executor 'uni')")
        if not args.enable_prefix_caching:
            raise ValueError("kv_transfer_config: needs prefix caching (blocks are addressed by their "
                             "prefix-cache hash); drop --no-enable-prefix-caching")
        if args.runner != "generate":
            raise ValueError("kv_transfer_config: only for runner='generate'")
        from pagedllm.spec_decode.config import SpeculativeConfig
        sc = SpeculativeConfig.from_any(args.speculative_config)
        if sc is not None and sc.uses_model:
            raise ValueError(f"kv_transfer_config: not with speculative_config.method {sc.method!r} (the "
                             "draft model's KV cache is not offloaded)")
        return cfg

    def _init_kv_connector(self, args: EngineArgs) -> tuple[Any, str]:
        """Both halves of the KV connector (scheduler side here, worker side on the rank) and
        the block-hash seed that makes block hashes stable across processes (the layout's
        fingerprint)."""
        from pagedllm.distributed.kv_transfer.base import KVCacheLayout, KVConnectorRole
        from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory
        from pagedllm.distributed.kv_transfer.offloading import model_fingerprint

        spec = self.executor.get_kv_cache_specs()[0]
        if spec.extra_bytes_per_token:
            raise ValueError("kv_transfer_config: not with a draft model's KV cache")
        fp = model_fingerprint(args, self.hf_config, getattr(self.loaded, "model_path", None), self.dtype,
                               self.kv_cache_dtype)
        layout = KVCacheLayout(num_layers=spec.num_layers, block_size=args.block_size,
                               num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                               dtype=str(self.kv_cache_dtype).replace("torch.", ""), model_fingerprint=fp,
                               hash_algo=args.prefix_caching_hash_algo)
        cfg = self.kv_transfer_config
        connector = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, layout)
        self.executor.collective_rpc("init_kv_connector", args=(cfg, layout))
        return connector, "kv-connector:" + layout.fingerprint

    def _init_cache(self, args: EngineArgs, t0: float) -> None:
        """Size the KV cache from every rank's budget and shape (the smallest fit wins), then
        have the workers allocate it."""
        info = self.executor.model_info
        self.loaded = info.loaded
        self.hf_config = info.loaded.hf_config
        self.tokenizer = info.loaded.tokenizer
        self.dtype, self.kv_cache_dtype, self.device = info.dtype, info.kv_cache_dtype, info.device
        self.vocab_size = info.vocab_size
        self.eos_token_id = info.eos_token_id
        self.weight_bytes = info.weight_bytes
        self.weight_file_bytes = getattr(info, "weight_file_bytes", 0)
        self.weight_mapped_bytes = getattr(info, "weight_mapped_bytes", 0)
        self.weight_mapped_path = getattr(info, "weight_mapped_path", None)
        self.pooler = self.executor.get_pooler()
        budgets = self.executor.determine_available_memory()
        specs = self.executor.get_kv_cache_specs()
        fits = [int(b // (s.bytes_per_token * args.block_size)) for b, s in zip(budgets, specs)]
        num_blocks = min(fits)
        rank = fits.index(num_blocks)
        kv_bytes, bytes_per_token = budgets[rank], specs[rank].bytes_per_token
        where = f" on rank {rank}" if len(fits) > 1 else ""
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory: {kv_bytes} bytes hold {num_blocks} block(s) of {args.block_size} tokens "
                f"({bytes_per_token * args.block_size} bytes each){where}; need at least 2")
        # Block 0 is reserved by the block pool as a null block.
        capacity_tokens = (num_blocks - 1) * args.block_size
        model_ctx = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or capacity_tokens
        if args.max_model_len is None:
            max_model_len = min(model_ctx, capacity_tokens)
        else:
            max_model_len = int(args.max_model_len)
            if max_model_len < 1:
                raise ValueError(f"max_model_len: must be >= 1, got {max_model_len}")
            if max_model_len > model_ctx:
                raise ValueError(
                    f"max_model_len: {max_model_len} exceeds the model's context length {model_ctx}")
            if max_model_len > capacity_tokens:
                raise ValueError(
                    f"max_model_len: {max_model_len} tokens do not fit in the KV cache{where} "
                    f"({_fmt_bytes(kv_bytes)} holds {capacity_tokens} tokens at {bytes_per_token} bytes/token); "
                    f"use max_model_len <= {capacity_tokens} or kv_cache_memory >= "
                    f"{(-(-max_model_len // args.block_size) + 1) * args.block_size * bytes_per_token} bytes")
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = args.block_size
        self.kv_capacity_tokens = capacity_tokens
        self.executor.initialize(num_blocks, max_model_len)
        self.kv_cache_bytes: int = num_blocks * args.block_size * bytes_per_token
        self.kv_block_bytes: int = args.block_size * bytes_per_token
        # Free blocks holding cached prefixes kept resident (ahead of never-used blocks, and
        # across the idle release): kv_prefix_cache_memory in whole blocks.
        self.kv_prefix_keep_blocks = args.kv_prefix_cache_bytes() // self.kv_block_bytes
        self.startup_seconds = time.perf_counter() - t0
        ranks = f" x {len(fits)} ranks" if len(fits) > 1 else ""
        logger.info(
            "pagedllm: model %s (%s, %s) loaded in %.2f s; weights %s%s; KV cache %s %s = %d blocks x %d tokens "
            "= %d tokens (%d bytes/token); max_model_len %d",
            args.model, self.hf_config.architectures[0], str(self.dtype).replace("torch.", ""),
            self.startup_seconds, _fmt_bytes(self.weight_bytes), ranks,
            str(self.kv_cache_dtype).replace("torch.", ""),
            _fmt_bytes(num_blocks * args.block_size * bytes_per_token),
            num_blocks, args.block_size, capacity_tokens, bytes_per_token, max_model_len)
        self._log_memory_plan()

    def _log_memory_plan(self) -> None:
        """One start-up line: where the resident memory goes (weights, KV cache, the activation
        workspace of a full step, the allocator's cache cap, and the rest: Python, torch, the
        tokenizer) against the resident size now."""
        mem = self.get_memory_stats()
        rss = mem["resident_memory_bytes"]
        args = self.args
        # A full step's largest activations: T tokens x (q|k|v + gate|up + a few hidden-sized
        # temporaries); per rank under tensor parallelism. An estimate for the log, not a bound.
        cfg = self.hf_config
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        inter = int(getattr(cfg, "intermediate_size", 0) or 0)
        elem = 4 if str(self.dtype) == "torch.float32" else 2
        workspace = args.max_num_batched_tokens * (6 * hidden + 2 * inter) * elem // max(1, args.tensor_parallel_size)
        cache_cap = mem.get("cpu_allocator_cache_limit_bytes")
        committed = self._kv_committed_bytes(0)
        weights_resident = self.weight_bytes
        from pagedllm.loader.mapped_weights import mapped_file_resident_bytes

        if self.weight_mapped_path:
            # NOTE: the worker runs in this process when the mapping is on (one rank)
            mapped_res = mapped_file_resident_bytes(self.weight_mapped_path)
            logger.info(
                "pagedllm: weights resident %s (%s mapped from the weight cache, file-backed and clean, %s of it "
                "resident now; %s copies) for a checkpoint file of %s",
                _fmt_bytes(mapped_res + self.weight_bytes - self.weight_mapped_bytes),
                _fmt_bytes(self.weight_mapped_bytes), _fmt_bytes(mapped_res),
                _fmt_bytes(self.weight_bytes - self.weight_mapped_bytes), _fmt_bytes(self.weight_file_bytes))
            weights_resident = mapped_res + self.weight_bytes - self.weight_mapped_bytes
        else:
            logger.info("pagedllm: weights resident %s as anonymous copies for a checkpoint file of %s",
                        _fmt_bytes(self.weight_bytes), _fmt_bytes(self.weight_file_bytes))
        rest = rss - weights_resident - committed - mem.get("cpu_allocator_cached_bytes", 0)
        logger.info(
            "pagedllm: memory plan: weights %s + KV cache %s reserved (%s committed now; pages committed "
            "on first write, cached prefixes kept up to %s) + step workspace ~%s (%d tokens) + allocator "
            "cache up to %s; resident now %s (of which Python, torch, tokenizer and buffers ~%s)",
            _fmt_bytes(self.weight_bytes), _fmt_bytes(self.kv_cache_bytes), _fmt_bytes(committed),
            _fmt_bytes(self.kv_prefix_keep_blocks * self.kv_block_bytes), _fmt_bytes(workspace),
            args.max_num_batched_tokens, _fmt_bytes(cache_cap) if cache_cap is not None else "n/a",
            _fmt_bytes(rss), _fmt_bytes(max(rest, 0)))

    def _kv_committed_bytes(self, num_committed_blocks: Optional[int] = None) -> int:
        """Bytes of the KV cache (one rank) that may be resident: the block pool's committed blocks
        (handed out since start-up or the last idle release) x bytes per block on CPU, where pages
        are committed on first write; the whole cache where it was allocated up front (CUDA,
        ``PAGEDLLM_KV_LAZY=0``)."""
        from pagedllm.worker.kv_memory import lazy_kv_enabled

        if not lazy_kv_enabled(self.device):
            return self.kv_cache_bytes
        if num_committed_blocks is None:
            kvm = getattr(self, "kv_cache_manager", None)
            num_committed_blocks = kvm.block_pool.num_committed_blocks if kvm is not None else 0
        return num_committed_blocks * self.kv_block_bytes

    # ------------------------------------------------------------------ in-process worker
    @property
    def model(self) -> Any:
        """The model of the in-process worker (``distributed_executor_backend="uni"`` only)."""
        return self._driver_worker().model

    @property
    def runner(self) -> Any:
        """The model runner of the in-process worker ("uni" only)."""
        return self._driver_worker().runner

    def _driver_worker(self) -> Any:
        w = getattr(self.executor, "driver_worker", None)
        if w is None:
            raise AttributeError(f"{type(self.executor).__name__} runs its workers in other processes")
        return w

    def shutdown(self) -> None:
        """Stop the executor's workers (processes / actors) and the KV event publisher; idempotent.
        With a KV connector, saves still queued are carried out first and its writers flushed."""
        conn = getattr(self, "kv_connector", None)
        if conn is not None:
            try:
                if self.scheduler.has_pending_kv_transfers() and not self.executor.is_failed:
                    self.step()
            except Exception:
                logger.warning("pagedllm: KV connector: final saves failed", exc_info=True)
            conn.shutdown()
            self.kv_connector = None
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue ``request``; one with structured outputs gets its grammar state (compiled on
        the manager's threads; it waits as WAITING_FOR_FSM until then).

        Raises:
            ValueError: structured outputs on a pooling engine, a duplicate id, LoRA not
                enabled, or an adapter that cannot be loaded (``LoRAAdapterError``).
        """
        if self.sleeping_tags:
            from pagedllm.worker.sleep import EngineSleepingError
            raise EngineSleepingError()
        if request.lora_request is not None:
            self.ensure_lora(request.lora_request)
        so_params = getattr(request.sampling_params, "structured_outputs", None)
        if so_params is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs: needs a generation model (runner='generate')")
            request.structured_output_request = self.structured_output_manager.new_request(
                so_params, request.prompt_token_ids)
        self.scheduler.add_request(request)

    # ------------------------------------------------------------------ LoRA
    def _check_lora_enabled(self) -> None:
        if not self.args.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the engine with enable_lora=True "
                             "(pagedllm serve --enable-lora)")

    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter into every rank's CPU cache (a no-op when it is there); True when it
        was read from disk.

        ``self.loras`` mirrors the workers' CPU caches (least recently used first, at most
        ``max_cpu_loras``): past the bound, the least recently used adapter that no unfinished
        request uses is unloaded first (if all are in use, the least recently used one: the
        workers read it again from its path when its requests next run).

        Raises:
            ValueError: LoRA not enabled, or ``LoRAAdapterError`` (the adapter cannot be loaded:
                the message names it); nothing changes then.
        """
        from pagedllm.lora.peft_loader import LoRAAdapterError

        self._check_lora_enabled()
        lid = lora_request.lora_int_id
        if lid in self.loras:
            self.loras.move_to_end(lid)
            return False
        if len(self.loras) >= self.max_cpu_loras:
            in_use = {r.lora_request.lora_int_id for r in self.scheduler.requests.values()
                      if r.lora_request is not None}
            victim = next((x for x in self.loras if x not in in_use), next(iter(self.loras)))
            self.remove_lora(victim)
        # NOTE: a worker answers an adapter it cannot load with the error's text instead of
        # raising: a failing RPC marks a multi-process executor dead.
        results = self.executor.collective_rpc("add_lora", args=(lora_request,))
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            raise LoRAAdapterError(errors[0])
        self.loras[lid] = lora_request
        return any(results)

    def ensure_lora(self, lora_request: Any) -> None:
        """``add_lora`` for a request's adapter (cheap when it is loaded)."""
        self.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from every rank's CPU cache and slots; True when a rank held it.
        Requests still running with it read it again from its path."""
        self._check_lora_enabled()
        self.loras.pop(lora_int_id, None)
        return any(self.executor.collective_rpc("remove_lora", args=(lora_int_id,)))

    def list_loras(self) -> set[int]:
        """Adapter ids loaded on the workers (the first rank's CPU cache)."""
        if not self.args.enable_lora:
            return set()
        return set(self.executor.collective_rpc("list_loras")[0])

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if request_ids:
            self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        """Requests running or waiting, or KV connector saves that need one more step."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_transfers()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model and update request states once (then publish the step's KV
        cache events, ``--kv-events-config``)."""
        out = self._step()
        if self.kv_events is not None:
            self.flush_kv_events()
        return out

    def flush_kv_events(self) -> None:
        """Hand the block pool's recorded KV cache events to the publisher (one batch)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.kv_cache_manager.block_pool.take_kv_events())

    def _step(self) -> list[EngineCoreOutput]:
        if self.batch_queue_size > 1:
            return self._step_with_batch_queue()
        so = self._schedule()
        runner_out = self.executor.execute_model(so)
        if so.is_empty and (self.scheduler.num_waiting_for_fsm() or self.scheduler.num_waiting_for_remote_kvs):
            # NOTE: only grammars still compiling (or KV transfers arriving): yield the CPU to the
            # compile (fetch) threads instead of spinning through empty steps.
            time.sleep(0.002)
        # NOTE: an empty step too: it returns the outputs of requests finished inside
        # schedule() (a grammar that failed to compile).
        assert not isinstance(runner_out, Future), "execute_model without non_block returns the output"
        return self.scheduler.update_from_output(so, runner_out or ModelRunnerOutput())

    def _schedule(self) -> SchedulerOutput:
        """``scheduler.schedule()`` plus the step's grammar bitmask for constrained rows."""
        so = self.scheduler.schedule()
        if so.structured_output_request_ids:
            assert self.structured_output_manager is not None, "constrained rows need the manager"
            reqs = self.scheduler.requests
            rids = list(so.structured_output_request_ids)
            # NOTE: a request verifying jump-forward drafts gets one row per position (its drafts:
            # the scheduled ones, ``Request.spec_token_ids`` trimmed in schedule()).
            so.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [reqs[rid].structured_output_request for rid in rids],
                [reqs[rid].spec_token_ids for rid in rids])
        return so

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism: keep up to ``batch_queue_size`` steps in flight so the stages
        overlap. A new batch is scheduled while earlier ones run (the scheduler skips requests
        whose tokens are all in flight); the oldest step's output is applied when the queue is
        full or nothing new could be scheduled."""
        q = self._batch_queue
        scheduled = False
        if len(q) < self.batch_queue_size:
            so = self._schedule()
            if not so.is_empty:
                q.append((so, self.executor.execute_model(so, non_block=True)))
                scheduled = True
            else:
                if so.finished_req_ids or so.preempted_req_ids:
                    self.executor.execute_model(so)  # NOTE: the workers drop finished requests' state
                failed = self.scheduler.update_from_output(so, ModelRunnerOutput())
                if failed:  # requests finished inside schedule() (a grammar that failed to compile)
                    return failed
        if not q or (scheduled and len(q) < self.batch_queue_size):
            return []
        so, fut = q.popleft()
        return self.scheduler.update_from_output(so, fut.result())

    def reset_prefix_cache(self) -> bool:
        ok = self.kv_cache_manager.reset_prefix_cache()
        self.flush_kv_events()
        return ok

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> int:
        """vLLM's ``sleep``: reset the prefix cache, give every KV page back (the cache's contents
        are forgotten), then have each rank free its weights (level 1: to a temporary file;
        level 2: dropped, reloaded from the checkpoint on wake; ``Worker.sleep``). A no-op when
        already asleep. Call with no unfinished requests (``LLMEngine.sleep`` aborts them).

        Returns:
            resident bytes released (summed over the ranks; KV pages per rank 0's block size).

        Raises:
            ValueError: sleep mode not enabled, a level other than 1 or 2, or unfinished requests.
        """
        from pagedllm.worker.sleep import check_level

        self._check_sleep_mode()
        level = check_level(level)
        if self.sleeping_tags:
            return 0
        if self.scheduler.has_unfinished_requests() or self._batch_queue:
            raise ValueError("sleep: requests are still running; abort them first")
        if self.scheduler.has_finished_requests():
            self.step()  # NOTE: hands finished requests' ids to the workers (they drop their state)
        self.reset_prefix_cache()
        kv = self.release_kv_pages(max_cached_kept=0) * self.kv_block_bytes
        results = self.executor.collective_rpc("sleep", args=(level,))
        released: int = kv + sum(r[0] for r in results)
        self.sleep_backup_bytes = sum(r[1] for r in results)
        self.sleeping_tags = {"weights", "kv_cache"}
        self.sleep_level = level
        logger.info("pagedllm: asleep (level %d): released %s of resident memory", level, _fmt_bytes(released))
        return released

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """vLLM's ``wake_up``: restore ``tags`` ("weights", "kv_cache"; None = both) on every
        rank; requests are accepted again once nothing is asleep. Tags not asleep are ignored.

        Raises:
            ValueError: sleep mode not enabled, or an unknown tag.
        """
        from pagedllm.worker.sleep import check_tags

        self._check_sleep_mode()
        tags = check_tags(tags)
        todo = [t for t in tags if t in self.sleeping_tags]
        if not todo:
            return
        self.executor.collective_rpc("wake_up", args=(todo,))
        if "weights" in todo and self.sleep_level == 2:
            # NOTE: the workers rebuilt their models: adapters are loaded again on first use.
            self.loras.clear()
            self.pooler = self.executor.get_pooler()
        self.sleeping_tags -= set(todo)
        if "weights" in todo:
            self.sleep_backup_bytes = 0
        if not self.sleeping_tags:
            self.sleep_level = 0
        logger.info("pagedllm: woke up %s%s", ", ".join(todo),
                    "" if not self.sleeping_tags else f" ({', '.join(sorted(self.sleeping_tags))} still asleep)")

    def is_sleeping(self) -> bool:
        """True while any tag is asleep."""
        return bool(self.sleeping_tags)

    def _check_sleep_mode(self) -> None:
        if not self.args.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled; start the engine with enable_sleep_mode=True "
                             "(pagedllm serve --enable-sleep-mode)")

    def get_scheduler_stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_preemptions_total": s.num_preemptions_total,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            **(self.structured_output_manager.stats() if self.structured_output_manager else {}),
            **self._spec_decode_stats(),
            **self._jump_forward_stats(),
            **(self._lora_stats() if self.args.enable_lora else {}),
            **(self.kv_events.stats() if self.kv_events is not None else {}),
            **({"kv_connector": self.kv_connector.get_kv_connector_stats()} if self.kv_connector else {}),
            **self._encoder_cache_stats(),
        }

    def _encoder_cache_stats(self) -> dict[str, Any]:
        """``{"encoder_cache": {usage, capacity (tokens), queries, hits, evictions (totals)}}`` of an
        in-process worker's encoder cache (image-text models); empty otherwise."""
        w = getattr(self.executor, "driver_worker", None)
        ec = getattr(getattr(w, "runner", None), "encoder_cache", None)
        if ec is None:
            return {}
        return {"encoder_cache": {"usage": ec.usage, "capacity": ec.capacity, "queries": ec.hits + ec.misses,
                                  "hits": ec.hits, "evictions": ec.evictions}}

    def release_idle_memory(self) -> int:
        """Between bursts of work: hand finished requests' ids to the workers (they drop their
        state), give the KV pages of free blocks beyond the kept prefixes back (``release_kv_pages``),
        then have every rank return its free allocator blocks and heap to the OS
        (``Worker.release_idle_memory``); call from the thread that steps the engine.

        Returns:
            resident bytes released, summed over the ranks (the KV pages counted per rank 0's
            block size).
        """
        if ((self.scheduler.has_finished_requests() or self.scheduler.has_pending_kv_transfers())
                and not self.scheduler.has_unfinished_requests()):
            self.step()
        kv = 0
        if not self.scheduler.has_unfinished_requests() and not self._batch_queue:
            kv = self.release_kv_pages() * self.kv_block_bytes
        released: int = kv + sum(self.executor.collective_rpc("release_idle_memory"))
        if self.executor.get_memory_stats().get("resident_memory_bytes"):  # workers elsewhere: this one too
            from pagedllm.platforms import trim_heap
            trim_heap()
        return released

    def release_kv_pages(self, max_cached_kept: Optional[int] = None) -> int:
        """Give the KV pages of free blocks back to the OS: every free block that holds no cached
        prefix, and the least recently used cached ones beyond ``max_cached_kept`` blocks (None =
        ``kv_prefix_cache_memory``'s). Each rank drops whole pages (madvise(2) MADV_DONTNEED) of
        those blocks, the never-used ones and the null block (contents not needed either, so
        pages shared with them go too); blocks that lost a page forget their prefix and count as
        uncommitted again. Call between steps, from the thread that steps the engine.

        Returns:
            blocks that went from committed to uncommitted.
        """
        import bisect

        from pagedllm.worker.kv_memory import block_runs, merge_runs

        if self.scheduler.has_pending_kv_transfers():
            return 0  # NOTE: queued KV connector saves still have to read those blocks
        pool = self.kv_cache_manager.block_pool
        candidates = pool.release_candidates(max_cached_kept)
        if not candidates:
            return 0
        unc = [b.block_id for b in pool.free_uncommitted.get_all_free_blocks()]
        runs = block_runs([0] + candidates + unc)
        touched: list[tuple[int, int]] = []
        for r in self.executor.collective_rpc("release_kv_blocks", args=(runs,)):
            touched.extend(tuple(x) for x in (r or ()))
        touched = merge_runs(touched)  # disjoint, sorted: the union over the ranks
        ends = [e for _, e in touched]
        lost = []
        for b in candidates:
            i = bisect.bisect_right(ends, b)  # the first range ending after b
            if i < len(touched) and touched[i][0] <= b:
                lost.append(b)
        n = pool.mark_uncommitted(lost)
        self.flush_kv_events()
        logger.debug("pagedllm: gave back the KV pages of %d free blocks (%s)", n,
                     _fmt_bytes(n * self.kv_block_bytes))
        return n

    def _jump_forward_stats(self) -> dict[str, Any]:
        """Jump-forward structured decoding totals (empty when off): verified grammar drafts,
        their tokens, and the accepted ones."""
        st = self.scheduler.jump_forward_stats
        if st is None:
            return {}
        return {"jump_forward_num_drafts": st.num_drafts,
                "jump_forward_num_draft_tokens": st.num_draft_tokens,
                "jump_forward_num_accepted_tokens": st.num_accepted_tokens}

    def _spec_decode_stats(self) -> dict[str, Any]:
        """Speculative decoding totals (empty when off): the scheduler's draft counters and, for
        an in-process worker, the suffix proposer's global cache."""
        st = self.scheduler.spec_stats
        if st is None:
            return {}
        out = {"spec_decode_num_drafts": st.num_drafts, "spec_decode_num_draft_tokens": st.num_draft_tokens,
               "spec_decode_num_accepted_tokens": st.num_accepted_tokens,
               "spec_decode_num_accepted_tokens_per_pos": list(st.num_accepted_tokens_per_pos),
               "spec_decode_method": getattr(self.spec_config, "method", None)}
        w = getattr(self.executor, "driver_worker", None)
        sd = getattr(getattr(w, "runner", None), "spec_decoder", None)
        if sd is not None:
            ps = sd.proposer.stats()
            if "suffix_cached_requests" in ps:
                out["spec_decode_suffix_cached_requests"] = ps["suffix_cached_requests"]
                out["spec_decode_suffix_tree_nodes"] = ps["suffix_global_tree_nodes"]
                out["spec_decode_suffix_cache_capacity"] = getattr(
                    self.spec_config, "suffix_decoding_max_cached_requests", None)
        return out

    def _lora_stats(self) -> dict[str, Any]:
        """``lora_running_adapters`` / ``lora_waiting_adapters`` (names), ``max_loras``,
        ``lora_cpu_cache_adapters`` (adapters loaded on the workers) and ``max_cpu_loras``."""
        running, waiting = self.scheduler.lora_adapter_names()
        return {"lora_running_adapters": running, "lora_waiting_adapters": waiting,
                "max_loras": self.args.max_loras, "lora_cpu_cache_adapters": len(self.loras),
                "max_cpu_loras": self.max_cpu_loras}

    def get_memory_stats(self) -> dict[str, Any]:
        """Memory now, in bytes: ``resident_memory_bytes`` (RSS of this process plus that of the
        executor's worker processes on this machine), ``weight_bytes``, ``weight_file_bytes`` (the
        checkpoint files), ``weight_mapped_bytes`` (weights served from the mapped weight cache, file-backed
        pages; ``loader.mapped_weights``), ``kv_cache_bytes`` (the
        output rank's weights; the KV cache of one rank, reserved), ``kv_cache_committed_bytes``
        (of which committed: blocks handed out since start-up or the last idle release) and,
        where the workers run in this process, the caching CPU allocator's
        ``cpu_allocator_cached_bytes`` (free blocks kept for reuse, at most
        ``cpu_allocator_cache_limit_bytes``) and ``cpu_allocator_live_bytes``.

        Reads ``/proc`` only (no call to the workers), so any thread may call it."""
        from pagedllm.metrics.memory import resident_memory_bytes

        out = {"resident_memory_bytes": resident_memory_bytes(), "weight_bytes": self.weight_bytes,
               "sleep_level": getattr(self, "sleep_level", 0),
               "sleep_weights_backup_bytes": getattr(self, "sleep_backup_bytes", 0),
               "weight_file_bytes": getattr(self, "weight_file_bytes", 0),
               "weight_mapped_bytes": getattr(self, "weight_mapped_bytes", 0),
               "kv_cache_bytes": getattr(self, "kv_cache_bytes", 0),
               "kv_cache_committed_bytes": self._kv_committed_bytes() if hasattr(self, "kv_block_bytes") else 0}
        extra = self.executor.get_memory_stats()
        out["resident_memory_bytes"] += extra.pop("resident_memory_bytes", 0)
        out.update(extra)
        return out
