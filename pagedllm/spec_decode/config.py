"""``speculative_config``: vLLM's names and defaults (``vllm.config.SpeculativeConfig``).

Pure Python (no torch), so the engine and the CLI can validate it before loading anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.config import dataclass_from_json
from pagedllm.spec_decode.registry import DRAFT_NONE, get_proposer_kind, registered_proposers


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings.

    Attributes:
        method: "ngram" | "suffix" | "draft_model" | "eagle" | "eagle3" | "mtp" or any method
            registered with ``spec_decode.registry.register_proposer``; None infers it
            from ``model`` (vLLM: "[ngram]"/"ngram" -> ngram, a name containing "eagle3" /
            "eagle" -> that, anything else -> draft_model).
        num_speculative_tokens: draft tokens per step (k >= 1). Required except for "suffix"
            (default ``suffix_decoding_max_tree_depth``) and "mtp" (default 1).
        model: the draft model / head checkpoint (path or known name). For "draft_model" it may
            be the target's own path with ``quantization`` set (a self-draft).
        quantization: quantization of the draft model ("int8", "int4", "w8a8" or None).
        prompt_lookup_min / prompt_lookup_max: n-gram length range (ngram); both default to 5,
            one given alone sets the other (vLLM's rule).
        disable_by_batch_size: no drafts in a step whose batch holds at least this many
            requests. None = the engine's measured automatic threshold (``auto_disable_batch_size``
            in the engine's log); 0 = never disable.
        suffix_decoding_max_tree_depth / suffix_decoding_max_cached_requests /
        suffix_decoding_max_spec_factor / suffix_decoding_min_token_prob: suffix decoding
            (vLLM's defaults 24 / 10000 / 1.0 / 0.1).
    """

    method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    model: Optional[str] = None
    quantization: Optional[str] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    disable_by_batch_size: Optional[int] = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        m = self.method
        if m is None:
            if self.model is None:
                raise ValueError("speculative_config: give 'method' (one of "
                                 f"{', '.join(registered_proposers())}) or a draft 'model'")
            name = str(self.model).lower()
            m = ("ngram" if name in ("ngram", "[ngram]") else "eagle3" if "eagle3" in name
                 else "eagle" if "eagle" in name else "draft_model")
        if m == "[ngram]":
            m = "ngram"
        kind = get_proposer_kind(m)  # ValueError naming the registered methods
        self.method = m
        if m == "ngram" and self.model in ("ngram", "[ngram]"):
            self.model = None
        k = self.num_speculative_tokens
        if k is None:
            if kind.default_num_speculative_tokens is not None:
                k = kind.default_num_speculative_tokens(self)
            else:
                raise ValueError(f"speculative_config.num_speculative_tokens: required for method {m!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
        self.num_speculative_tokens = k
        if m == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if kind.requires_model and not self.model:
            raise ValueError(f"speculative_config.model: required for method {m!r}")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
            raise ValueError(f"speculative_config.disable_by_batch_size: must be an integer >= 0, got {d!r}")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError("speculative_config.suffix_decoding_max_tree_depth: must be >= 2")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests: must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor: must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob: must be in [0, 1]")

    @property
    def uses_model(self) -> bool:
        """The proposer loads weights (a draft model or a head), so it runs on one rank."""
        return get_proposer_kind(self.method).draft != DRAFT_NONE

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a decoding request's scheduled tokens that the proposer writes (a draft
        model's own drafts: ``k``); 0 for token-only proposers."""
        return self.num_speculative_tokens if get_proposer_kind(self.method).writes_lookahead_kv else 0

    @classmethod
    def from_any(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """A SpeculativeConfig from a dict, a JSON string (``--speculative-config``), an
        instance, or None.

        Raises:
            ValueError: invalid JSON, an unknown key (named), or an invalid value.
        """
        if value is None or isinstance(value, cls):
            return value
        return dataclass_from_json(cls, value, "speculative_config")
