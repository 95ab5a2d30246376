"""asyncio front end for the server: the engine is built and its loop runs in its own thread.

Each request gets an ``asyncio.Queue``; the engine thread collects a step's RequestOutputs and
hands them over with one ``loop.call_soon_threadsafe`` per step, so the HTTP side never blocks
the loop and vice versa. Adds and
aborts cross into the engine thread through a command queue drained before every step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, TypeVar

from pagedllm import envs
from pagedllm.config import EngineArgs
from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedllm")

_T = TypeVar("_T")


class _Deliveries:
    """Outputs the engine thread produced, handed to the event loop in one wakeup per step.

    NOTE: one ``call_soon_threadsafe`` per output woke the HTTP thread up to once per stream per
    step, each wakeup taking a core from the engine's OpenMP threads on a small machine.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._lock = threading.Lock()

    def add(self, q: asyncio.Queue[Any], item: Any) -> None:
        with self._lock:
            self._items.append((q, item))

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items:
            try:
                self._loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # event loop closed during shutdown
                pass


def _deliver(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class _LoopQueue:
    """Adapter the output processor writes to from the engine thread (delivered at the next flush)."""

    def __init__(self, deliveries: _Deliveries, q: asyncio.Queue[Any]) -> None:
        self._deliveries = deliveries
        self._q = q

    def put_nowait(self, item: Any) -> None:
        self._deliveries.add(self._q, item)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error."""


class AsyncLLM:
    """Async engine used by the OpenAI server (see ``generate``); an ``EngineClient``.

    Attributes:
        tokenizer: the model's tokenizer.
        input_processor: the engine's InputProcessor (the one input path: the server builds
            its EngineCoreRequests with it).
        max_model_len: max prompt + output tokens.
        vocab_size: model vocabulary size.
        model_name: the model argument.
        runner: "generate" or "pooling".
        pooler: the model's Pooler (tasks, labels), None for a generation model.
        default_sampling_params: dict of defaults from the model's generation config.
        kv_capacity_tokens: tokens the KV cache holds.
        stat_loggers: objects with ``record(scheduler_stats, iteration_stats)``, called after
            every engine step from the engine thread.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self._cmds: "queue.SimpleQueue[tuple[Any, ...]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop_known = threading.Event()  # set by _ensure_started (or shutdown)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._deliveries: Optional[_Deliveries] = None
        self._queues: dict[str, _LoopQueue] = {}  # engine thread: requests it holds
        self._ids_in_use: set[str] = set()  # event-loop side: ids from add until the caller is done
        self._dead: Optional[BaseException] = None
        self._stats_lock = threading.Lock()
        self._idle_since: Optional[float] = None
        self._idle_released = False
        self._idle_release_s = float(envs.get("PAGEDLLM_IDLE_RELEASE_S"))
        # NOTE: the engine is built and stepped on one thread. OpenMP (libgomp) gives each thread
        # that enters a parallel region its own team of workers, and once the process has more
        # of them than cores it spins only ~100 times before sleeping, so each of a step's
        # hundreds of parallel regions paid a futex wake-up: loading the model on the caller's
        # thread and stepping on another made a batch-16 decode step 29 ms instead of 20.5 ms
        # (benchmarks/results/performance-history-2026-11.md, step 24).
        built = threading.Event()
        init_error: list[BaseException] = []
        self._thread = threading.Thread(target=self._thread_main, args=(args, built, init_error),
                                        name="pagedllm-engine", daemon=True)
        self._thread.start()
        try:
            built.wait()
        except KeyboardInterrupt:
            # NOTE: the build cannot be interrupted inside C++; leaving the interpreter while
            # the thread runs there aborted the process (SIGABRT). Let it finish, then stop it.
            self._stop.set()
            self._loop_known.set()
            self._thread.join()
            raise
        if init_error:
            self._thread.join()
            raise init_error[0]
        self.engine.collect_stats = True
        self.tokenizer = self.engine.tokenizer
        self.input_processor = self.engine.input_processor
        self.max_model_len = self.engine.max_model_len
        self.model_config = self.engine.model_config  # vLLM's AsyncLLM.model_config
        self.vocab_size = self.engine.vocab_size
        self.model_name = args.model
        self.runner = args.runner
        self.pooler = self.engine.pooler
        self.default_sampling_params = dict(self.engine.default_sampling_params)
        self.kv_capacity_tokens = self.engine.core.kv_capacity_tokens
        # NOTE: opt-in (issue 30): the tokenizer tables cost 173 MiB resident for Gemma 3's 262k vocab.
        if (self.engine.core.structured_output_manager is not None
                and envs.get("PAGEDLLM_STRUCTURED_OUTPUTS_PREWARM")):
            self.engine.core.structured_output_manager.prewarm()
        self.stat_loggers: list[Any] = []
        self._last_stats: dict[str, Any] = self.engine.core.get_scheduler_stats()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(args)

    # ------------------------------------------------------------------ loop
    def _thread_main(self, args: EngineArgs, built: threading.Event, init_error: list[BaseException]) -> None:
        """The engine thread: build the engine, wait for the event loop, then run the step loop."""
        from pagedllm.engine.llm_engine import LLMEngine

        try:
            self.engine = LLMEngine(args)
        except BaseException as e:  # reported to the constructor's caller
            init_error.append(e)
            return
        finally:
            built.set()
        self._loop_known.wait()
        if not self._stop.is_set():
            self._run()

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        """Bind the engine to the running event loop on first use; returns that loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._deliveries = _Deliveries(self._loop)
            self._loop_known.set()
        return self._loop

    def _submit(self, cmd: tuple[Any, ...]) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _drain(self) -> int:
        """Apply queued adds/aborts in the engine thread; returns how many were applied."""
        eng = self.engine
        n = 0
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return n
            n += 1
            kind = cmd[0]
            if kind == "add":
                _, request, q = cmd
                try:
                    eng.add_request(request, queue=q)
                except Exception as e:  # this request's error only: nothing else is touched
                    q.put_nowait(e)
                    continue
                self._queues[request.request_id] = q
            elif kind == "abort":
                ids = [r for r in cmd[1] if r in self._queues]
                for r in ids:
                    self._queues.pop(r, None)
                if ids:
                    eng.abort_request(ids)
            elif kind == "reset_prefix_cache":
                fut, loop = cmd[1], cmd[2]
                ok = eng.core.reset_prefix_cache()
                loop.call_soon_threadsafe(lambda f=fut, v=ok: f.done() or f.set_result(v))
            elif kind == "call":  # an engine method run on this thread, its result to a future
                _, fut, loop, fn, args = cmd
                try:
                    res, err = fn(*args), None
                except Exception as e:  # the caller's error (e.g. an adapter that cannot be loaded)
                    res, err = None, e

                def settle(f: asyncio.Future[Any] = fut, r: Any = res, x: Optional[Exception] = err) -> None:
                    if not f.done():
                        f.set_exception(x) if x is not None else f.set_result(r)

                loop.call_soon_threadsafe(settle)

    def _record_stats(self) -> None:
        eng = self.engine
        stats = eng.core.get_scheduler_stats()
        with self._stats_lock:
            self._last_stats = stats
        it_stats = eng.pop_iteration_stats()
        for lg in self.stat_loggers:
            try:
                lg.record(stats, it_stats)
            except Exception:  # a metrics bug must not stop the engine
                logger.exception("stat logger failed")

    def _run(self) -> None:
        eng = self.engine
        deliveries = self._deliveries
        assert deliveries is not None, "_ensure_started sets the deliveries before the thread starts"
        while not self._stop.is_set():
            try:
                self._loop_once(eng)
            finally:
                deliveries.flush()  # one event-loop wakeup per step for all outputs
            if self._dead is not None:
                return

    def _loop_once(self, eng: LLMEngine) -> None:
        """One iteration of the engine thread: apply commands, then one step (or wait for work)."""
        try:
            drained = self._drain()
            if not eng.has_unfinished_requests():
                if drained:  # e.g. an abort emptied the batch: publish the new state
                    self._record_stats()
                assert self._deliveries is not None
                self._deliveries.flush()
                self._maybe_release_idle_memory(eng)
                self._wake.wait(0.5)
                self._wake.clear()
                return
            self._idle_since = None
            outputs = eng.step()
            for o in outputs:
                if o.finished:
                    self._queues.pop(o.request_id, None)
            self._record_stats()
        except Exception as e:  # engine bug: fail in-flight requests, keep serving new ones
            logger.exception("engine step failed; aborting in-flight requests")
            ids = list(self._queues)
            for rid in ids:
                self._queues[rid].put_nowait(e)
            self._queues.clear()
            if getattr(eng.core.executor, "is_failed", False):
                self._dead = e  # NOTE: a rank died, hung or failed: no step can run any more
            try:
                eng.abort_request(ids)
            except Exception:
                logger.exception("abort after failure failed")
                self._dead = e

    def _maybe_release_idle_memory(self, eng: LLMEngine) -> None:
        """Once per idle period of ``PAGEDLLM_IDLE_RELEASE_S`` seconds (default 10; 0 = never),
        return the workers' free allocator blocks and heap to the OS, so an idle server holds its
        weights, KV cache and runtime, not the last burst's activations."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since, self._idle_released = now, False
            if self._idle_release_s > 0:  # the batch just emptied: drop the burst's workspace (issue 30)
                try:
                    eng.core.executor.collective_rpc("trim_workspace")
                except Exception:  # NOTE: a worker without it (or a dead rank): the idle release still runs
                    logger.debug("trim_workspace failed", exc_info=True)
            return
        if self._idle_released or self._idle_release_s <= 0 or now - self._idle_since < self._idle_release_s:
            return
        self._idle_released = True
        released = eng.core.release_idle_memory()
        logger.debug("idle for %.0f s: released %d bytes of resident memory", now - self._idle_since, released)

    def _check_can_add(self, request_id: str) -> None:
        """Start the loop if needed; refuse a dead engine or a request id in use."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop is dead: {self._dead!r}")
        self._ensure_started()
        if request_id in self._ids_in_use:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if self.engine.core.sleeping_tags:
            from pagedllm.worker.sleep import EngineSleepingError
            raise EngineSleepingError()

    def _add(self, request: EngineCoreRequest) -> asyncio.Queue[Any]:
        """Hand a validated request to the engine thread; its outputs arrive on the returned queue."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        assert self._deliveries is not None, "call _ensure_started() first"
        self._ids_in_use.add(request.request_id)  # released by the caller's finally (generate / encode)
        self._submit(("add", request, _LoopQueue(self._deliveries, q)))
        return q

    def _engine_request(self, prompt: Any, params: Any, request_id: str, pooling: bool,
                        lora_request: Any = None, **kw: Any) -> EngineCoreRequest:
        """``prompt`` itself when it is an EngineCoreRequest (its id must be ``request_id``; its
        own ``lora_request`` is used), else ``LLMEngine.process_inputs`` of it with
        ``lora_request`` (the server's length rule: ``strict_length``).

        Raises:
            ValueError: a mismatched id or kind, a ``lora_request`` that differs from the
                EngineCoreRequest's, LoRA not enabled, or an invalid input.
        """
        if isinstance(prompt, EngineCoreRequest):
            if prompt.request_id != request_id:
                raise ValueError(f"request_id: {request_id!r} does not match the EngineCoreRequest's "
                                 f"{prompt.request_id!r}")
            if prompt.is_pooling != pooling:
                what = "pooling (use encode)" if prompt.is_pooling else "generation (use generate)"
                raise ValueError(f"request: {request_id!r} is a {what} request")
            if lora_request is not None and lora_request != prompt.lora_request:
                raise ValueError(f"lora_request: differs from the EngineCoreRequest's ({prompt.lora_request!r}); "
                                 "set it in process_inputs")
            request = prompt
        else:
            request = self.engine.process_inputs(request_id, prompt, params, strict_length=not pooling,
                                                 wait_for_grammar=False, lora_request=lora_request, **kw)
        self._check_lora(request.lora_request)
        return request

    @property
    def enable_lora(self) -> bool:
        """LoRA adapters can be served (``EngineArgs.enable_lora``)."""
        return bool(self.args.enable_lora)

    @property
    def kv_transfer_config(self) -> Optional[Any]:
        """``EngineArgs.kv_transfer_config`` (None without a KV connector)."""
        return getattr(self.args, "kv_transfer_config", None)

    def _check_lora(self, lora_request: Any) -> None:
        if lora_request is not None and not self.args.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the server with --enable-lora")

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the engine thread (between steps) and return its result."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop is dead: {self._dead!r}")
        loop = self._ensure_started()
        fut: asyncio.Future[_T] = loop.create_future()
        self._submit(("call", fut, self._loop, fn, args))
        return await fut

    # ------------------------------------------------------------------ API
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str,
                       add_special_tokens: bool = True, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's RequestOutputs (per ``sampling_params.output_kind``).

        Args:
            prompt: an ``EngineCoreRequest`` from ``input_processor.process_inputs`` (what the
                server sends; its own params are used), or text, a TextPrompt or a TokensPrompt
                (processed here with the server's rule: prompt + max_tokens <= max_model_len).
            sampling_params: SamplingParams.
            request_id: unique id.
            add_special_tokens: tokenizer flag for text prompts (False for chat-templated text).
            lora_request: the LoRA adapter to run with (``enable_lora``), or None.

        Raises:
            ValueError: invalid input (before anything is yielded): empty prompt, ids out of
                vocabulary, prompt + max_tokens over max_model_len, bad parameters, duplicate id,
                LoRA not enabled or an adapter that cannot be loaded.
            EngineDeadError: the engine loop has died.
        """
        self._check_can_add(request_id)
        request = self._engine_request(prompt, sampling_params, request_id, False, lora_request,
                                       add_special_tokens=add_special_tokens)
        params = request.sampling_params
        grammar = self.engine.grammar_future(params)
        q = self._add(request)
        finished = False
        try:
            if grammar is not None:
                # NOTE: the request is already queued (it waits in the scheduler while its grammar
                # compiles on the manager's threads); a compile error is raised here as the
                # request's ValueError (HTTP 400) and the finally clause aborts it.
                try:
                    # NOTE: shielded: a cancelled wait (client gone) must not cancel the compile,
                    # which other requests with the same constraint share through the cache.
                    await asyncio.shield(asyncio.wrap_future(grammar))
                except ValueError as e:
                    so_params = getattr(params, "structured_outputs", None)
                    if so_params is None:
                        raise
                    raise so_params.rename_error(e) from None
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._ids_in_use.discard(request_id)
            if not finished:
                self._submit(("abort", [request_id]))

    async def encode(self, prompt: Any, pooling_params: Any, request_id: str, *, task: Optional[str] = None,
                     add_special_tokens: bool = True, lora_request: Any = None) -> PoolingRequestOutput:
        """Run one pooling request (``runner="pooling"``) and return its PoolingRequestOutput.

        Args:
            prompt: an ``EngineCoreRequest`` (pooling; its own params are used), or text, or
                ``{"prompt_token_ids": [...]}`` (used exactly as given).
            pooling_params: PoolingParams or None.
            request_id: unique id.
            task: "embed", "classify", "score" or "encode" (default: ``pooling_params.task``,
                else the model's conversion).
            add_special_tokens: tokenizer flag for text prompts.
            lora_request: the LoRA adapter to run with (``enable_lora``), or None.

        Raises:
            ValueError: not a pooling model, a task it does not serve, an invalid parameter, an
                empty prompt or one over max_model_len, a duplicate id (nothing is run then).
            EngineDeadError: the engine loop has died.
        """
        from pagedllm.pooling_params import PoolingParams

        self._check_can_add(request_id)
        params = PoolingParams() if pooling_params is None else pooling_params
        request = self._engine_request(prompt, params, request_id, True, lora_request, task=task,
                                       add_special_tokens=add_special_tokens)
        q = self._add(request)
        done = False
        try:
            item: PoolingRequestOutput | BaseException = await q.get()
            done = True
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            self._ids_in_use.discard(request_id)
            if not done:
                self._submit(("abort", [request_id]))

    async def abort(self, request_id: str) -> None:
        """Abort a request and free its KV blocks (no-op when unknown or finished)."""
        self._submit(("abort", [request_id]))

    async def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache from the engine thread; True on success."""
        loop = self._ensure_started()
        fut: asyncio.Future[bool] = loop.create_future()
        self._submit(("reset_prefix_cache", fut, loop))
        return await fut

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter on the workers, between steps; True when read from disk.

        Raises:
            ValueError: LoRA not enabled, or ``LoRAAdapterError`` naming the adapter.
        """
        self._check_lora(lora_request)
        return await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter, between steps; True when it was loaded."""
        return await self._call(self.engine.remove_lora, lora_int_id)

    async def list_loras(self) -> set[int]:
        """Ids of the adapters loaded on the workers."""
        return await self._call(self.engine.list_loras)

    # ------------------------------------------------------------------ sleep mode
    async def sleep(self, level: int = 1) -> None:
        """Sleep mode (``LLMEngine.sleep``), on the engine thread between steps: requests still in
        flight end with ``EngineSleepingError`` (the server has already aborted its own), then
        the prefix cache is reset and the KV cache and weights are released.

        Raises:
            ValueError: sleep mode not enabled, or ``level`` not 1 or 2.
        """
        from pagedllm.worker.sleep import check_level

        self.engine.core._check_sleep_mode()
        check_level(level)
        await self._call(self._sleep_now, level)

    def _sleep_now(self, level: int) -> int:
        from pagedllm.worker.sleep import EngineSleepingError

        err = EngineSleepingError("The request was aborted: the model was put to sleep.")
        ids = list(self._queues)
        for rid in ids:
            self._queues[rid].put_nowait(err)
        self._queues.clear()
        released = self.engine.sleep(level)
        self._record_stats()
        return released

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """``LLMEngine.wake_up(tags)`` on the engine thread.

        Raises:
            ValueError: sleep mode not enabled, or an unknown tag.
        """
        self.engine.core._check_sleep_mode()
        from pagedllm.worker.sleep import check_tags
        check_tags(tags)
        await self._call(self.engine.wake_up, tags)
        self.pooler = self.engine.pooler

    async def is_sleeping(self) -> bool:
        """True while any tag is asleep."""
        return self.engine.core.is_sleeping()

    @property
    def sleeping(self) -> bool:
        """``is_sleeping()`` without awaiting (safe from any thread)."""
        return bool(self.engine.core.sleeping_tags)

    def get_scheduler_stats(self) -> dict[str, Any]:
        """The last step's scheduler snapshot; its ``kv_connector`` entry is read live from a
        connector whose counters are thread safe (P2P transfers end while the engine idles)."""
        with self._stats_lock:
            stats = dict(self._last_stats)
        conn = getattr(self.engine.core, "kv_connector", None)
        if conn is not None and getattr(conn, "stats_thread_safe", False):
            stats["kv_connector"] = conn.get_kv_connector_stats()
        return stats

    def get_memory_stats(self) -> dict[str, Any]:
        """Process memory in bytes (``EngineCore.get_memory_stats``); safe from any thread."""
        return self.engine.core.get_memory_stats()

    def get_kv_events_stats(self) -> dict[str, Any]:
        """The KV event publisher's counters (``KVEventPublisher.stats``), {} when events are off;
        safe from any thread."""
        pub = self.engine.core.kv_events
        return pub.stats() if pub is not None else {}

    def make_prometheus_logger(self, model_name: str, max_model_len: int, prefix: str = "pagedllm") -> Any:
        """The server's Prometheus stat logger for this engine (metric names ``{prefix}:...``)."""
        from pagedllm.metrics.prometheus import PrometheusStatLogger
        return PrometheusStatLogger(model_name=model_name, max_model_len=max_model_len, prefix=prefix)

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` when the engine loop has died or a worker rank has died or
        hangs (the message names the rank)."""
        if self._dead is not None or (self._thread is not None and not self._thread.is_alive()
                                      and not self._stop.is_set()):
            raise EngineDeadError(f"engine loop is dead: {self._dead!r}")
        executor = self.engine.core.executor
        try:
            executor.check_health()
        except Exception as e:
            raise EngineDeadError(f"engine is dead: {e}") from None

    def shutdown(self) -> None:
        """Abort every request and stop the engine thread."""
        ids = list(self._queues)
        if ids:
            self._submit(("abort", ids))
        self._stop.set()
        self._wake.set()
        self._loop_known.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # NOTE: stops worker processes / Ray actors
