"""Synchronous front end: input processing, n-way fan-out, the core's step, output processing."""
from __future__ import annotations

import itertools
import time
from typing import Any, Optional

from pagedllm.config import EngineArgs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.metrics.stats import IterationStats, RequestStateStats
from pagedllm.outputs import RequestOutput


def child_request_id(index: int, parent_id: str) -> str:
    """Id of sample ``index`` of an ``n > 1`` request (vLLM's scheme)."""
    return f"{index}_{parent_id}"


class LLMEngine:
    """Adds requests and steps the engine; used by the offline ``LLM`` and ``AsyncLLM``.

    Args:
        args: EngineArgs.
    """

    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.engine.output_processor import OutputProcessor

        self.args = args
        self.core = EngineCore(args)
        self.tokenizer = self.core.tokenizer
        if args.chat_template:
            self.tokenizer.chat_template = load_chat_template(args.chat_template)
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size,
                                              args.max_logprobs)
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
        # pooling request id -> (prompt token ids, queue or None)
        self._pooling: dict[str, tuple[list[int], Any]] = {}

    def _generation_defaults(self) -> dict:
        """Default sampling values from the model's generation config (vLLM ``--generation-config``)."""
        gc = self.args.generation_config
        if gc == "vllm":
            return {}
        cfg: dict = {}
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

    def get_default_sampling_params(self):
        from pagedllm.sampling_params import SamplingParams
        return SamplingParams(**self.default_sampling_params)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def validate(self, prompt: Any, params: Any, strict_length: bool = False,
                 add_special_tokens: bool = True, wait_for_grammar: bool = True):
        """Tokenize and validate one request without adding it.

        A request with ``structured_outputs``: with ``wait_for_grammar`` its grammar is compiled
        (on the manager's threads, or a cache hit) before this returns, so a constraint no backend
        can compile raises here; without it, only the backend name is checked (the async front
        end then starts and awaits ``grammar_future`` itself).

        Returns:
            (ProcessedPrompt, SamplingParams with max_tokens filled).

        Raises:
            ValueError: naming the offending field.
        """
        if self.args.runner == "pooling":
            raise ValueError("this model was loaded with runner='pooling' and does not generate text; use "
                             "embed/encode/classify/score, or load it with runner='generate'")
        pp = self.input_processor.process_prompt(
            prompt, getattr(params, "truncate_prompt_tokens", None), add_special_tokens)
        params = self.input_processor.process_sampling_params(params, len(pp.prompt_token_ids), strict_length)
        if params.structured_outputs is not None:
            if wait_for_grammar:
                try:
                    self.grammar_future(params).result()
                except ValueError as e:
                    raise params.structured_outputs.rename_error(e) from None
            elif self.core.structured_output_manager is not None:
                self.core.structured_output_manager.resolve_backend(params.structured_outputs)
        return pp, params

    def grammar_future(self, params: Any):
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

    def add_processed_request(self, request_id: str, pp: Any, params: Any,
                              queue: Any = None, arrival_time: Optional[float] = None,
                              lora_request: Any = None) -> None:
        """Add an already validated request (fans out ``n > 1`` into child requests).

        ``lora_request``: the LoRA adapter the request runs with (loaded on the workers first
        when they do not hold it).

        Raises:
            ValueError: LoRA not enabled, or an adapter that cannot be loaded (nothing is added).
        """
        from pagedllm.engine.output_processor import ParentRequest
        from pagedllm.pooling_params import PoolingParams

        if lora_request is not None:
            self.core.ensure_lora(lora_request)  # NOTE: before any state: a bad adapter adds nothing
        if isinstance(params, PoolingParams):
            self.add_processed_pooling_request(request_id, pp, params, queue, arrival_time, lora_request)
            return
        arrival_time = time.time() if arrival_time is None else arrival_time
        n = params.n
        if n == 1:
            self.output_processor.add_request(
                request_id, pp.prompt, pp.prompt_token_ids, params, None, 0, arrival_time=arrival_time,
                queue=queue)
            self._add_core(request_id, pp, params, arrival_time, lora_request)
            return
        parent = ParentRequest(request_id, params)
        kids = []
        for i in range(n):
            cp = params.clone()
            cp.n = 1
            if params.seed is not None:
                cp.seed = params.seed + i
            cid = child_request_id(i, request_id)
            kids.append((cid, cp))
            self.output_processor.add_request(
                cid, pp.prompt, pp.prompt_token_ids, cp, parent, i, arrival_time=arrival_time, queue=queue)
        for cid, cp in kids:
            self._add_core(cid, pp, cp, arrival_time, lora_request)
        self._children[request_id] = [cid for cid, _ in kids]

    def _add_core(self, rid: str, pp: Any, params: Any, arrival_time: float, lora_request: Any = None) -> None:
        req = Request(rid, pp.prompt_token_ids, sampling_params=params, eos_token_id=self.core.eos_token_id,
                      arrival_time=arrival_time, cache_salt=pp.cache_salt, lora_request=lora_request)
        if params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            req.skip_prefix_cache = True
        self.core.add_request(req)
        if self.collect_stats:
            self._req_stats[rid] = (req, RequestStateStats(num_prompt_tokens=len(pp.prompt_token_ids)))

    def add_request(self, request_id: str, prompt: Any, params: Any, queue: Any = None,
                    strict_length: bool = False, lora_request: Any = None) -> None:
        """Validate and add a generation request (with ``lora_request``: run with that LoRA
        adapter).

        Raises:
            ValueError: naming the offending field; nothing is added then.
        """
        pp, params = self.validate(prompt, params, strict_length)
        self.add_processed_request(request_id, pp, params, queue, lora_request=lora_request)

    # ------------------------------------------------------------------ pooling
    def validate_pooling(self, prompt: Any, pooling_params: Any, task: str,
                         add_special_tokens: bool = True):
        """Tokenize and validate one pooling request (``task``: "embed", "classify", "score",
        "encode") without adding it.

        Returns:
            (ProcessedPrompt, verified PoolingParams clone).

        Raises:
            ValueError: a generation model, a task this model does not serve, an invalid
                parameter, an empty prompt or one over ``max_model_len`` (never cut unless
                ``truncate_prompt_tokens``).
        """
        pooler = getattr(self.core, "pooler", None)
        if pooler is None:
            raise ValueError(f"this model is not a pooling model (loaded with runner={self.args.runner!r}); "
                             f"{task} needs runner='pooling' (--runner pooling)")
        params = pooler.prepare_params(pooling_params, task)
        t = params.truncate_prompt_tokens
        if t == -1:
            t = self.max_model_len
        pp = self.input_processor.process_prompt(prompt, t, add_special_tokens)
        return pp, params

    def add_processed_pooling_request(self, request_id: str, pp: Any, params: Any, queue: Any = None,
                                      arrival_time: Optional[float] = None, lora_request: Any = None) -> None:
        """Add a validated pooling request: prefill only; its PoolingRequestOutput comes out of
        ``step()`` (and into ``queue`` when given) after its last prefill chunk."""
        if request_id in self._pooling:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if lora_request is not None:
            self.core.ensure_lora(lora_request)
        arrival_time = time.time() if arrival_time is None else arrival_time
        req = Request(request_id, pp.prompt_token_ids, sampling_params=None, pooling_params=params,
                      eos_token_id=self.core.eos_token_id, arrival_time=arrival_time, lora_request=lora_request)
        self.core.add_request(req)
        self._pooling[request_id] = (list(pp.prompt_token_ids), queue)

    def add_pooling_request(self, request_id: str, prompt: Any, pooling_params: Any,
                            task: Optional[str] = None, queue: Any = None, lora_request: Any = None) -> None:
        """Validate and add a pooling request (``task`` defaults to ``pooling_params.task``, else
        the model's: "embed" or "classify").

        Raises:
            ValueError: see ``validate_pooling``; nothing is added then.
        """
        pooler = getattr(self.core, "pooler", None)
        task = task or getattr(pooling_params, "task", None) or (pooler.task if pooler else "embed")
        pp, params = self.validate_pooling(prompt, pooling_params, task)
        self.add_processed_pooling_request(request_id, pp, params, queue, lora_request=lora_request)

    def _pooling_outputs(self, core_outputs: list) -> tuple[list, list]:
        """Split finished pooling requests off the core outputs as PoolingRequestOutputs."""
        from pagedllm.outputs import PoolingOutput, PoolingRequestOutput

        pooled, rest = [], []
        for co in core_outputs:
            entry = self._pooling.pop(co.req_id, None)
            if entry is None:
                rest.append(co)
                continue
            ids, q = entry
            if co.pooled is None:
                err = RuntimeError(f"pooling request {co.req_id} finished without a pooled output")
                if q is None:
                    raise err
                q.put_nowait(err)
                continue
            out = PoolingRequestOutput(request_id=co.req_id, outputs=PoolingOutput(co.pooled),
                                       prompt_token_ids=ids, finished=True)
            if q is not None:
                q.put_nowait(out)
            pooled.append(out)
        return pooled, rest

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (parent ids of n > 1 requests abort every child)."""
        for rid in request_ids:
            self._pooling.pop(rid, None)
        core_ids = []
        for rid in request_ids:
            kids = self._children.pop(rid, None)
            core_ids.extend(kids if kids else [rid])
        self.core.abort_requests(core_ids)
        self.output_processor.abort_requests(core_ids)
        self._observe_finished(core_ids, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

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
        """Stop the executor's worker processes / actors (idempotent)."""
        self.core.shutdown()

    def _observe_finished(self, core_ids: list[str], reason: str) -> None:
        now = time.time()
        for rid in core_ids:
            entry = self._req_stats.pop(rid, None)
            if entry is not None:
                req, st = entry
                st.observe(self._iter_stats, req.arrival_time, req.first_scheduled_time, now, 0, False, reason)

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
            "engine.pooling": len(self._pooling),
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

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the RequestOutputs produced (per ``output_kind``)."""
        core_outputs = self.core.step()
        if not core_outputs:
            return []
        pooled: list = []
        if self._pooling:
            pooled, core_outputs = self._pooling_outputs(core_outputs)
            if not core_outputs:
                return pooled
        now = time.time()
        it = self._iter_stats
        for co in core_outputs:
            entry = self._req_stats.get(co.req_id)
            if entry is None:
                continue
            req, st = entry
            st.observe(it, req.arrival_time, req.first_scheduled_time, now, len(co.new_token_ids),
                       st.first_token_time is None and len(co.new_token_ids) > 0, co.finish_reason)
            if co.finish_reason is not None:
                del self._req_stats[co.req_id]
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
            self._observe_finished(to_abort, "stop")
        for o in outputs:
            if o.finished:
                self._children.pop(o.request_id, None)
        return pooled + outputs if pooled else outputs


def load_chat_template(value: str) -> str:
    """``--chat-template``: a path to a file holding a Jinja template, or the template itself."""
    import os
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if any(c in value for c in "{}\n") or not os.path.splitext(value)[1]:
        return value
    raise ValueError(f"chat_template: file {value!r} does not exist")
