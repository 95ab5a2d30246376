"""Engine-wide structured-output settings (vLLM's ``--structured-outputs-config`` JSON)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from pagedllm.structured_output.params import BACKEND_NAMES, DEFAULT_MAX_WHITESPACE_CNT


@dataclass
class StructuredOutputsConfig:
    """Settings of the structured-output manager.

    Attributes:
        backend: "auto" (xgrammar, or llguidance for what xgrammar cannot compile),
            "xgrammar" or "guidance" (vLLM's names).
        disable_fallback: with "auto", never fall back from xgrammar to guidance.
        disable_any_whitespace: default for every request: compact JSON (no whitespace).
        max_whitespace_cnt: the most whitespace characters JSON may have in one run between
            two tokens (default 16; None: unbounded, which lets a model that favours newlines
            emit them until ``max_tokens``). Applies to JSON schemas, ``json_object``, forced
            tool calls and the JSON inside structural tags; a request's own
            ``whitespace_pattern`` (guidance backend) replaces it.
        disable_additional_properties: default for every request: JSON objects get only the
            properties their schema names.
        grammar_cache_size: compiled grammars kept (LRU, by backend and constraint); >= 1.
        compile_threads: threads that compile grammars off the engine thread; >= 1.
        reasoning_parser: name of a reasoning parser (``pagedllm.reasoning``; the server's
            ``--reasoning-parser``): constraints start only once the reasoning has ended, so
            the thinking text is free and only the answer is constrained (vLLM's field).
        enable_in_reasoning: constrain the reasoning too (ignore ``reasoning_parser`` here).
        jump_forward: lossless jump-forward decoding (default on): where the grammar allows only
            one continuation (a JSON schema's fixed keys and punctuation), its canonical tokens
            are proposed as draft tokens and verified by the model in one forward pass, with the
            grammar's bitmask at every position, so the output is exactly that of step-by-step
            constrained decoding (greedy: the same tokens; seeded sampling: the same tokens, as
            each position draws from the request's generator as a plain step does).
        jump_forward_max_tokens: most draft tokens one jump-forward proposes (>= 1).
        jump_forward_disable_batch_size: no jump-forward drafts while this many requests or more
            run (0: never switch off). Verifying k drafts adds k rows to a step; on a CPU a step of
            8 rows costs nearly 8 single-row steps, so drafts only pay in small batches (measured:
            1 request 1.02-1.27x, 8 requests 0.78x, ``benchmarks/results/jump-forward-2026-12-01.json``);
            like speculative decoding's ``disable_by_batch_size``. Lossless either way.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    max_whitespace_cnt: Optional[int] = DEFAULT_MAX_WHITESPACE_CNT
    disable_additional_properties: bool = False
    grammar_cache_size: int = 256
    compile_threads: int = 2
    reasoning_parser: Optional[str] = None
    enable_in_reasoning: bool = False
    jump_forward: bool = True
    jump_forward_max_tokens: int = 16
    jump_forward_disable_batch_size: int = 4

    @classmethod
    def from_any(cls, value: Optional[Any]) -> "StructuredOutputsConfig":
        """From None (defaults), a config, or a dict (``--structured-outputs-config``).

        Raises:
            ValueError: an unknown key or value, naming ``structured_outputs_config.<key>``.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config: must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown key(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**value)
        if cfg.backend not in BACKEND_NAMES:
            raise ValueError(f"structured_outputs_config.backend: must be one of {list(BACKEND_NAMES)}, "
                             f"got {cfg.backend!r}")
        if cfg.reasoning_parser is not None:
            from pagedllm.reasoning import ReasoningParserManager
            try:
                ReasoningParserManager.get_reasoning_parser(cfg.reasoning_parser)
            except KeyError as e:
                raise ValueError(f"structured_outputs_config.reasoning_parser: {e.args[0]}") from None
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "enable_in_reasoning", "jump_forward"):
            if not isinstance(getattr(cfg, name), bool):
                raise ValueError(f"structured_outputs_config.{name}: must be a boolean")
        v = cfg.max_whitespace_cnt
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError("structured_outputs_config.max_whitespace_cnt: must be an integer >= 1 "
                             f"or null (unbounded), got {v!r}; for no whitespace at all use "
                             "disable_any_whitespace")
        for name in ("grammar_cache_size", "compile_threads", "jump_forward_max_tokens"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"structured_outputs_config.{name}: must be an integer >= 1, got {v!r}")
        v = cfg.jump_forward_disable_batch_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError("structured_outputs_config.jump_forward_disable_batch_size: must be an integer "
                             f">= 0 (0: never switch off), got {v!r}")
        return cfg
