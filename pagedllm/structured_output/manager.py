"""The engine's structured-output manager: picks a backend, compiles grammars off the engine
thread into a bounded cache, hands each request a matcher, and builds each step's bitmask.

Design after vLLM v1's ``StructuredOutputManager``: compilation runs on a small thread pool,
keyed by (backend, canonical constraint) so identical constraints compile once; the scheduler
keeps a request whose grammar is still compiling waiting without blocking the others.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from pagedllm.structured_output.backend import (CompiledGrammar, GrammarSpec, StructuredOutputBackend,
                                                clean_error)
from pagedllm.structured_output.config import StructuredOutputsConfig
from pagedllm.structured_output.grammar_cache import GrammarCache
from pagedllm.structured_output.params import BACKEND_NAMES, StructuredOutputsParams
from pagedllm.structured_output.request import StructuredOutputRequest

logger = logging.getLogger("pagedllm")


def _make_backend(name: str, tokenizer: Any, vocab_size: int,
                  eos_token_id: Optional[int]) -> StructuredOutputBackend:
    if name == "xgrammar":
        from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
        return XgrammarBackend(tokenizer, vocab_size, eos_token_id)
    if name == "guidance":
        from pagedllm.structured_output.guidance_backend import GuidanceBackend
        return GuidanceBackend(tokenizer, vocab_size, eos_token_id)
    raise ValueError(f"unknown structured-output backend {name!r}; one of {list(BACKEND_NAMES)}")


class StructuredOutputManager:
    """Compiles and caches grammars, and creates per-request grammar state.

    Args:
        tokenizer: the engine's (fast) Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (bitmask width ``ceil(vocab_size / 32)`` words).
        eos_token_id: the model's EOS (allowed only where a grammar may end).
        config: a StructuredOutputsConfig (or its dict / None).

    Thread-safety: ``grammar_future``, ``compile``, ``new_request`` and ``stats`` may be called
    from any thread; bitmask filling happens on the engine thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int],
                 config: Any = None) -> None:
        self.config = StructuredOutputsConfig.from_any(config)
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_id = eos_token_id
        self.bitmask_words = (self.vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._cache = GrammarCache(self.config.grammar_cache_size)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._backends: dict[str, Future] = {}
        # Totals since start (exported by the engine's scheduler stats).
        self.num_queries = 0
        self.num_hits = 0
        self.num_compiled = 0
        self.num_failed = 0
        # Compile durations not yet drained by pop_compile_seconds() (bounded: an engine nobody
        # collects metrics from keeps only the latest).
        self._compile_seconds: deque[float] = deque(maxlen=1024)

    # ------------------------------------------------------------------ backends
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.compile_threads,
                                            thread_name_prefix="pagedllm-grammar")
        return self._pool

    def _backend(self, name: str) -> StructuredOutputBackend:
        """The backend ``name``, built once (blocking; call from a compile thread)."""
        with self._lock:
            fut = self._backends.get(name)
            owner = fut is None
            if owner:
                fut = self._backends[name] = Future()
        if owner:
            t0 = time.perf_counter()
            try:
                fut.set_result(_make_backend(name, self.tokenizer, self.vocab_size, self.eos_token_id))
                logger.info("pagedllm: structured outputs: %s backend ready in %.2f s", name,
                            time.perf_counter() - t0)
            except BaseException as e:
                fut.set_exception(e)
        return fut.result()

    def prewarm(self) -> None:
        """Build the default backend on a compile thread now (a server does this at start-up, so
        the first constrained request does not pay the tokenizer scan: ~0.4 s for SmolLM2)."""
        name = "xgrammar" if self.config.backend == "auto" else self.config.backend
        self._executor().submit(self._backend, name).add_done_callback(lambda f: f.exception())

    def resolve_backend(self, params: StructuredOutputsParams) -> str:
        """The backend a request uses: its own (``guided_decoding_backend``) or the engine's.

        Raises:
            ValueError: an unknown backend name.
        """
        name = params._backend or self.config.backend
        if name not in BACKEND_NAMES:
            raise ValueError(f"guided_decoding_backend: must be one of {list(BACKEND_NAMES)}, got {name!r}")
        return name

    # ------------------------------------------------------------------ compile
    def spec_for(self, params: StructuredOutputsParams) -> tuple[str, GrammarSpec]:
        """(backend name, canonical spec): the cache key of ``params``."""
        cfg = self.config
        return self.resolve_backend(params), GrammarSpec.from_params(
            params, cfg.disable_any_whitespace, cfg.disable_additional_properties,
            cfg.max_whitespace_cnt)

    def grammar_future(self, params: StructuredOutputsParams, count: bool = True) -> Future:
        """The compiled grammar of ``params``: a cache hit, or a compile started on the pool.

        Args:
            count: count this lookup in the cache statistics (the engine's second lookup of a
                request already counted by its front end passes False).

        Returns:
            a Future of a CompiledGrammar; its exception is a ValueError naming the field when
            no backend can compile the constraint.
        """
        key = self.spec_for(params)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and fut.cancelled():  # shut down mid-compile: compile again
                fut = None
            if count:
                self.num_queries += 1
                self.num_hits += fut is not None
            if fut is None:
                fut = self._executor().submit(self._compile, *key)
                self._cache.put(key, fut)
        return fut

    def compile(self, params: StructuredOutputsParams, timeout: Optional[float] = None) -> CompiledGrammar:
        """Blocking ``grammar_future(params).result()``. Raises ValueError naming the field."""
        return self.grammar_future(params).result(timeout)

    def _compile(self, backend: str, spec: GrammarSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            if backend != "auto":
                out = self._backend(backend).compile(spec)
            else:
                out = self._compile_auto(spec)
        except Exception as e:
            with self._lock:
                self.num_failed += 1
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"{spec.field}: cannot compile it: {clean_error(e)}") from None
        dt = time.perf_counter() - t0
        with self._lock:
            self.num_compiled += 1
            self._compile_seconds.append(dt)
        return out

    def _compile_auto(self, spec: GrammarSpec) -> CompiledGrammar:
        """xgrammar first; llguidance for what xgrammar refuses (unless ``disable_fallback``)."""
        try:
            return self._backend("xgrammar").compile(spec)
        except ValueError as e:
            if self.config.disable_fallback:
                raise
            first = clean_error(e)
        try:
            return self._backend("guidance").compile(spec)
        except ValueError as e:
            second = clean_error(e)
        raise ValueError(f"{first} (the guidance backend cannot either: {second.removeprefix(spec.field + ': ')})")

    # ------------------------------------------------------------------ requests
    @property
    def reasoner(self) -> Any:
        """The reasoning parser whose reasoning stays unconstrained, or None."""
        cfg = self.config
        if cfg.reasoning_parser is None or cfg.enable_in_reasoning:
            return None
        if getattr(self, "_reasoner", None) is None:
            from pagedllm.reasoning import ReasoningParserManager
            self._reasoner = ReasoningParserManager.get_reasoning_parser(
                cfg.reasoning_parser)(self.tokenizer)
        return self._reasoner

    def new_request(self, params: StructuredOutputsParams,
                    prompt_token_ids: Optional[list[int]] = None) -> StructuredOutputRequest:
        """Grammar state for one core request (not counted as a cache query). With a reasoning
        parser, the grammar starts after the reasoning ends (in the prompt or in the output)."""
        encode = self._encode if self.config.jump_forward else None
        return StructuredOutputRequest(self.grammar_future(params, count=False), self.reasoner,
                                       prompt_token_ids, encode)

    def _encode(self, text: str) -> list[int]:
        """Canonical token ids of ``text`` (no special tokens): jump-forward drafts."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def grammar_bitmask(self, requests: list[StructuredOutputRequest],
                        drafts: Optional[list[list[int]]] = None) -> Any:
        """The step's bitmask: one row per request, or ``1 + len(drafts[i])`` consecutive rows for
        a request verifying draft tokens (the allowed tokens after each accepted draft), in
        request order.

        Returns:
            int32 torch tensor ``[sum(1 + len(d)), ceil(vocab_size / 32)]`` on the CPU (a fresh
            tensor: the runner may use it after the next step starts).
        """
        import torch

        ks = [len(d) for d in drafts] if drafts is not None else [0] * len(requests)
        bitmask = torch.full((len(requests) + sum(ks), self.bitmask_words), -1, dtype=torch.int32)
        row = 0
        for i, r in enumerate(requests):
            if not r.is_terminated():
                r.fill_bitmask(bitmask, row, drafts[i] if ks[i] else None)
            row += 1 + ks[i]
        return bitmask

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        """Totals: ``structured_output_cache_queries`` / ``_hits``, ``..._grammars_compiled`` /
        ``_failed``, ``..._cache_entries`` / ``_capacity`` / ``_evictions``."""
        with self._lock:
            return {
                "structured_output_cache_queries": self.num_queries,
                "structured_output_cache_hits": self.num_hits,
                "structured_output_grammars_compiled": self.num_compiled,
                "structured_output_compile_failures": self.num_failed,
                "structured_output_cache_entries": len(self._cache),
                "structured_output_cache_capacity": self._cache.capacity,
                "structured_output_cache_evictions": self._cache.evictions,
            }

    def pop_compile_seconds(self) -> list[float]:
        """Compile durations (seconds) since the last call (for the metrics histogram)."""
        with self._lock:
            out = list(self._compile_seconds)
            self._compile_seconds.clear()
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
