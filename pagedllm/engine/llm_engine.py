"""Synchronous front end: input processing, n-way fan-out, the core's step, output processing."""
from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from pagedllm.config import EngineArgs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.chat import load_chat_template
from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.model_config import ModelConfig, build_model_config
from pagedllm.metrics.stats import IterationStats, RequestStateStats

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


def child_request_id(index: int, parent_id: str) -> str:
    """Id of sample ``index`` of an ``n > 1`` request (vLLM's scheme)."""
    return f"{index}_{parent_id}"


class LLMEngine:
    """Adds requests and steps the engine; used by the offline ``LLM`` and ``AsyncLLM``.

    Args:
        args: EngineArgs.
    """

    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.engine.gc_tuning import collector_paused, freeze_startup_heap, full_collections

        # NOTE: start-up allocates millions of long-lived objects (modules, tokenizer tables,
        # configs); automatic collections over them found nothing worth ~0.25 s per start. The
        # worker's explicit collection after loading still runs, then the freeze's.
        full_before = full_collections()
        with collector_paused():
            self._construct(args)
        # NOTE: last, once the start-up heap is complete (pagedllm.engine.gc_tuning).
        freeze_startup_heap(self, full_before)

    def _construct(self, args: EngineArgs) -> None:
        from pagedllm.engine.output_processor import OutputProcessor

        self.args = args
        # OpenTelemetry (--otlp-traces-endpoint): before the model loads, so a missing SDK fails fast.
        self.tracer = None
        if args.otlp_traces_endpoint:
            from pagedllm.tracing import init_tracer
            self.tracer = init_tracer(args.otlp_traces_endpoint)
        self.core = EngineCore(args)
        self.tokenizer = self.core.tokenizer
        if args.chat_template:
            self.tokenizer.chat_template = load_chat_template(args.chat_template)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.vocab_size
        #: the loaded model's settings under vLLM's names (``llm.llm_engine.model_config``)
        self.model_config: ModelConfig = build_model_config(args, self.core)
        self.pooler = self.core.pooler
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size,
                                              args.max_logprobs, runner=args.runner, pooler=self.pooler,
                                              eos_token_id=self.core.eos_token_id,
                                              scheduling_policy=args.scheduling_policy)
        if args.enable_prompt_embeds:
            hc = self.core.hf_config
            hc = hc.get_text_config() if hasattr(hc, "get_text_config") else hc
            self.input_processor.enable_prompt_embeds(int(hc.hidden_size), self.core.dtype)
        from pagedllm.multimodal.processing import build_image_processor
        self.input_processor.image_processor = build_image_processor(args, self.core)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.default_sampling_params = self._generation_defaults()
        self._ids = itertools.count()
        # Per core request: (Request, RequestStateStats) for TTFT/ITL/e2e metrics.
        self._req_stats: dict[str, tuple[Request, RequestStateStats]] = {}
        self._iter_stats = IterationStats()
        self._preemptions_seen = 0
        # Set by AsyncLLM, which drains pop_iteration_stats() every step; offline runs skip it.
        self.collect_stats = False
        # parent request id -> child core request ids
        self._children: dict[str, list[str]] = {}

    def _generation_defaults(self) -> dict[str, Any]:
        """Default sampling values from the model's generation config (vLLM ``--generation-config``)."""
        gc = self.args.generation_config
        if gc == "vllm":
            return {}
        cfg: dict[str, Any] = {}
        if gc == "auto":
            cfg = dict(self.core.loaded.generation_config or {})
        else:
            import json
            import os
            path = os.path.join(gc, "generation_config.json") if os.path.isdir(gc) else gc
            try:
                with open(path) as f:
                    cfg = json.load(f)
            except OSError as e:
                raise ValueError(f"generation_config: cannot read {path!r}: {e}") from None
        out = {}
        for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty"),
                         ("max_new_tokens", "max_tokens")):
            if cfg.get(src) is not None:
                out[dst] = cfg[src]
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        from pagedllm.sampling_params import SamplingParams
        return SamplingParams(**self.default_sampling_params)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def process_inputs(self, request_id: str, prompt: Any, params: Any, *, task: Optional[str] = None,
                       strict_length: bool = False, add_special_tokens: bool = True,
                       arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                       lora_request: Any = None, priority: int = 0,
                       wait_for_grammar: bool = True) -> EngineCoreRequest:
        """``InputProcessor.process_inputs`` plus the structured-outputs check.

        A request with ``structured_outputs``: with ``wait_for_grammar`` its grammar is compiled
        (on the manager's threads, or a cache hit) before this returns, so a constraint no backend
        can compile raises here; without it, only the backend name is checked (the async front
        end then starts and awaits ``grammar_future`` itself).

        Returns:
            the EngineCoreRequest (not added).

        Raises:
            ValueError: naming the offending field (``InputValidationError`` with ``param``).
        """
        req = self.input_processor.process_inputs(
            request_id, prompt, params, task=task, strict_length=strict_length,
            add_special_tokens=add_special_tokens, arrival_time=arrival_time, cache_salt=cache_salt,
            lora_request=lora_request, priority=priority)
        so = req.structured_outputs
        if so is not None:
            if wait_for_grammar:
                try:
                    fut = self.grammar_future(req.sampling_params)
                    assert fut is not None, "req.structured_outputs is its params' structured_outputs"
                    fut.result()
                except ValueError as e:
                    raise so.rename_error(e) from None
            elif self.core.structured_output_manager is not None:
                self.core.structured_output_manager.resolve_backend(so)
        return req

    def grammar_future(self, params: Any) -> Optional[Future[Any]]:
        """The compile of ``params.structured_outputs`` (a ``concurrent.futures.Future`` whose
        exception is a ValueError naming the field), or None without structured outputs.

        Raises:
            ValueError: an unknown backend name, or an engine that cannot constrain (pooling).
        """
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return None
        mgr = self.core.structured_output_manager
        if mgr is None:
            raise ValueError("structured_outputs: needs a generation model (runner='generate')")
        return mgr.grammar_future(so)

    def add_request(self, request: Any, prompt: Any = None, params: Any = None, queue: Any = None,
                    strict_length: bool = False, *, task: Optional[str] = None,
                    lora_request: Any = None) -> None:
        """Add a request: an ``EngineCoreRequest`` (already processed), or a request id with a
        prompt and its SamplingParams / PoolingParams (processed here). An ``n > 1`` request
        fans out into ``n`` child requests; its outputs come out of ``step()`` (into ``queue``
        when given: anything with ``put_nowait``).

        A request with a ``lora_request`` (the EngineCoreRequest's, or the argument with the
        id form) runs with that LoRA adapter (loaded on the workers first when they do not hold it).

        Raises:
            ValueError: naming the offending field, a request id in use, LoRA not enabled, or an
                adapter that cannot be loaded (the message names it); nothing is added then.
        """
        if not isinstance(request, EngineCoreRequest):
            request = self.process_inputs(request, prompt, params, task=task, strict_length=strict_length,
                                          lora_request=lora_request)
        if request.lora_request is not None:
            # NOTE: before any state: a bad adapter (or LoRA off) adds nothing
            self.core.ensure_lora(request.lora_request)
        # NOTE: a prompt given as embeddings has placeholder ids: no detokenizer context from them,
        # and none reported back (RequestOutput.prompt_token_ids is empty, as vLLM's is None).
        shown_ids = [] if request.prompt_embeds is not None else request.prompt_token_ids
        if request.pooling_params is not None:
            self.output_processor.add_request(
                request.request_id, request.prompt, shown_ids, request.pooling_params,
                arrival_time=request.arrival_time, queue=queue)
            self._add_core(request.request_id, request, None)
            return
        from pagedllm.engine.output_processor import ParentRequest

        rid, params = request.request_id, request.sampling_params
        if params.n == 1:
            self.output_processor.add_request(
                rid, request.prompt, shown_ids, params, None, 0,
                arrival_time=request.arrival_time, queue=queue)
            self._add_core(rid, request, params)
            return
        parent = ParentRequest(rid, params)
        kids = []
        for i in range(params.n):
            cid, cp = parent.get_child_info(i)
            kids.append((cid, cp))
            self.output_processor.add_request(
                cid, request.prompt, shown_ids, cp, parent, i,
                arrival_time=request.arrival_time, queue=queue)
        added: list[str] = []
        try:
            for cid, cp in kids:
                self._add_core(cid, request, cp)
                added.append(cid)
        except BaseException:
            self.core.abort_requests(added)
            self.output_processor.abort_requests([rid])
            for cid in added:
                self._req_stats.pop(cid, None)
            raise
        self._children[rid] = [cid for cid, _ in kids]

    def _add_core(self, rid: str, request: EngineCoreRequest, sampling_params: Any) -> None:
        eos = request.eos_token_id if request.eos_token_id is not None else self.core.eos_token_id
        req = Request(rid, request.prompt_token_ids, sampling_params=sampling_params,
                      pooling_params=request.pooling_params, eos_token_id=eos,
                      arrival_time=request.arrival_time, cache_salt=request.cache_salt,
                      priority=request.priority, lora_request=request.lora_request,
                      prompt_embeds=request.prompt_embeds, prompt_embeds_hash=request.prompt_embeds_hash,
                      mm_features=request.mm_features)
        try:
            self.core.add_request(req)
        except BaseException:
            self.output_processor.abort_requests([rid])
            raise
        if self.collect_stats or self.tracer is not None:
            req.trace_headers = request.trace_headers
            self._req_stats[rid] = (req, RequestStateStats(num_prompt_tokens=len(request.prompt_token_ids)))

    def add_pooling_request(self, request_id: str, prompt: Any, pooling_params: Any,
                            task: Optional[str] = None, queue: Any = None, lora_request: Any = None) -> None:
        """``add_request`` of a pooling request (``task`` defaults to ``pooling_params.task``,
        else the model's: "embed" or "classify"; ``lora_request``: the LoRA adapter to run with).

        Raises:
            ValueError: naming the offending field; nothing is added then.
        """
        from pagedllm.pooling_params import PoolingParams

        params = PoolingParams() if pooling_params is None else pooling_params
        self.add_request(request_id, prompt, params, queue, task=task, lora_request=lora_request)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (parent ids of n > 1 requests abort every child)."""
        core_ids = []
        for rid in request_ids:
            kids = self._children.pop(rid, None)
            core_ids.extend(kids if kids else [rid])
        self.core.abort_requests(core_ids)
        self.output_processor.abort_requests(core_ids)
        self._observe_finished(core_ids, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (vLLM's ``LLMEngine`` method; the
        children of an ``n > 1`` request count one each)."""
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (vLLM's ``LLMEngine.get_tokenizer``)."""
        return self.tokenizer

    def get_model_config(self) -> ModelConfig:
        """The loaded model's settings (vLLM's ``LLMEngine.get_model_config``): ``self.model_config``."""
        return self.model_config

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> int:
        """Abort every unfinished request, then ``EngineCore.sleep(level)``; returns the resident
        bytes released.

        Raises:
            ValueError: sleep mode not enabled, or a level other than 1 or 2.
        """
        from pagedllm.worker.sleep import check_level

        self.core._check_sleep_mode()
        check_level(level)
        ids = list(self.core.scheduler.requests)
        if ids:
            self.core.abort_requests(ids)
            self.output_processor.abort_requests(ids)
            self._observe_finished(ids, "abort")
            self._children.clear()
        return self.core.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """``EngineCore.wake_up(tags)``; a level-2 wake also refreshes the pooler the input
        processor checks pooling requests against."""
        self.core.wake_up(tags)
        self.pooler = self.core.pooler
        self.input_processor.pooler = self.pooler

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter on the workers (``EngineCore.add_lora``)."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter (``EngineCore.remove_lora``)."""
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded on the workers."""
        return self.core.list_loras()

    def shutdown(self) -> None:
        """Stop the executor's worker processes / actors and flush the tracer (idempotent); the
        engine that froze the process's start-up heap unfreezes it (``engine.gc_tuning``)."""
        from pagedllm.engine.gc_tuning import release_startup_heap
        release_startup_heap(self)
        self.core.shutdown()
        if self.tracer is not None:
            from pagedllm.tracing import shutdown_tracer
            shutdown_tracer(self.tracer)

    def _observe_finished(self, core_ids: list[str], reason: str) -> None:
        now = time.time()
        for rid in core_ids:
            entry = self._req_stats.pop(rid, None)
            if entry is not None:
                req, st = entry
                st.observe(self._iter_stats, req.arrival_time, req.first_scheduled_time, now, 0, False, reason)
                if self.tracer is not None:
                    self._trace(req, st, now, reason)

    def _trace(self, req: Request, st: RequestStateStats, now: float, reason: Optional[str]) -> None:
        """Export the finished request's span (``pagedllm.tracing``); a failing exporter never
        fails the step."""
        from pagedllm.tracing import record_request_span

        names = self.args.served_model_name
        model = (names[0] if isinstance(names, (list, tuple)) and names else names) or self.args.model
        try:
            record_request_span(
                self.tracer, request_id=req.request_id, model=str(model), trace_headers=req.trace_headers,
                sampling_params=req.sampling_params, arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time, first_token_time=st.first_token_time,
                finish_time=now, num_prompt_tokens=st.num_prompt_tokens,
                num_generation_tokens=st.num_generation_tokens, finish_reason=reason)
        except Exception:
            logger.warning("pagedllm: exporting the span of request %s failed", req.request_id, exc_info=True)

    def get_request_state_counts(self) -> dict[str, int]:
        """Entries in every per-request structure the engine keeps, by name.

        Each is bounded by the unfinished requests (what ``has_unfinished_requests`` counts; an
        ``n > 1`` request counts once per sample) plus, for the runner's state and the
        scheduler's ``finished_req_ids``, those finished since the last step (freed by the next
        one): after the work is done and one more ``step()``, every count is 0. The soak tests
        and ``pagedllm bench`` use it to show that nothing is kept per finished request.
        """
        core = self.core
        sched, kv = core.scheduler, core.kv_cache_manager
        out = {
            "scheduler.requests": len(sched.requests),
            "scheduler.finished_req_ids": len(sched.finished_req_ids),
            "kv_cache_manager.req_to_blocks": len(kv.req_to_blocks),
        }
        try:
            runner = core.runner
        except AttributeError:  # workers in other processes: their state is theirs to count
            runner = None
        if runner is not None:
            out.update({"runner.generators": len(runner.generators),
                        "runner.pool_state": len(runner.pool_state),
                        "runner.input_batch": len(runner.input_batch.row_of)})
        return {
            **out,
            "output_processor.request_states": len(self.output_processor.request_states),
            "output_processor.parent_requests": len(self.output_processor.parent_requests),
            "engine.req_stats": len(self._req_stats),
            "engine.children": len(self._children),
        }

    def pop_iteration_stats(self) -> IterationStats:
        """Metrics gathered since the last call (tokens, TTFTs, ITLs, finished requests)."""
        it = self._iter_stats
        total = self.core.scheduler.num_preemptions_total
        it.num_preempted = total - self._preemptions_seen
        self._preemptions_seen = total
        mgr = self.core.structured_output_manager
        if mgr is not None:
            it.grammar_compile_seconds = mgr.pop_compile_seconds()
        self._iter_stats = IterationStats()
        return it

    def step(self) -> list[Any]:
        """One engine step; returns the RequestOutputs (per ``output_kind``) and
        PoolingRequestOutputs produced for requests added without a queue."""
        core_outputs = self.core.step()
        if not core_outputs:
            return []
        now = time.time()
        it = self._iter_stats
        # NOTE: no per-request loop when no stats are kept (offline, no tracer): nothing to observe.
        for co in core_outputs if self._req_stats else ():
            entry = self._req_stats.get(co.req_id)
            if entry is None:
                continue
            req, st = entry
            if req.pooling_params is not None and co.finish_reason is not None:
                it.num_prompt_tokens += st.num_prompt_tokens  # NOTE: its prefill is its whole work
            st.observe(it, req.arrival_time, req.first_scheduled_time, now, len(co.new_token_ids),
                       st.first_token_time is None and len(co.new_token_ids) > 0, co.finish_reason)
            if co.finish_reason is not None:
                del self._req_stats[co.req_id]
                if self.tracer is not None:
                    self._trace(req, st, now, co.finish_reason)
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
            self._observe_finished(to_abort, "stop")
        if not self.collect_stats and self.tracer is not None:
            self._iter_stats = IterationStats()  # offline tracing: nobody drains the step metrics
        for o in outputs:
            if o.finished:
                self._children.pop(o.request_id, None)
        return outputs
