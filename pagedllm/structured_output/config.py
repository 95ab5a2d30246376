"""Engine-wide structured-output settings (vLLM's ``--structured-outputs-config`` JSON)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from pagedllm.structured_output.params import BACKEND_NAMES


@dataclass
class StructuredOutputsConfig:
    """Settings of the structured-output manager.

    Attributes:
        backend: "auto" (xgrammar, or llguidance for what xgrammar cannot compile),
            "xgrammar" or "guidance" (vLLM's names).
        disable_fallback: with "auto", never fall back from xgrammar to guidance.
        disable_any_whitespace: default for every request: compact JSON (no free whitespace).
        disable_additional_properties: default for every request: JSON objects get only the
            properties their schema names.
        grammar_cache_size: compiled grammars kept (LRU, by backend and constraint); >= 1.
        compile_threads: threads that compile grammars off the engine thread; >= 1.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    grammar_cache_size: int = 256
    compile_threads: int = 2

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
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(cfg, name), bool):
                raise ValueError(f"structured_outputs_config.{name}: must be a boolean")
        for name in ("grammar_cache_size", "compile_threads"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"structured_outputs_config.{name}: must be an integer >= 1, got {v!r}")
        return cfg
