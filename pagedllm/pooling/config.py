"""``PoolerConfig`` with vLLM's names (``vllm.config.PoolerConfig``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")


@dataclass
class PoolerConfig:
    """How a pooling model turns hidden states into one output per input.

    Attributes:
        pooling_type: "LAST" (final token), "MEAN" (average over every token), "CLS" (first token)
            or "ALL" (every token's hidden state). None = the task's default (LAST for causal LMs).
        normalize: L2-normalize embeddings (default True for embed).
        use_activation: apply the classifier's activation (softmax, or sigmoid for one label)
            for classify/score (default True).
        dimensions: default Matryoshka truncation for embeddings.

    Raises:
        ValueError: unknown pooling_type.
    """

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None
    use_activation: Optional[bool] = None
    dimensions: Optional[int] = None
    softmax: Optional[bool] = None
    activation: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type: must be one of {POOLING_TYPES}, "
                                 f"got {self.pooling_type!r}")
        if self.use_activation is None:
            # vLLM's older names for the same switch.
            for alias in (self.activation, self.softmax):
                if alias is not None:
                    self.use_activation = alias
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config.dimensions: must be >= 1, got {self.dimensions}")

    @classmethod
    def from_any(cls, value) -> "PoolerConfig":
        """Build from None, a dict, a JSON string or a PoolerConfig.

        Raises:
            ValueError: bad JSON or unknown keys.
        """
        import dataclasses
        import json

        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config: invalid JSON: {e}") from None
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config: expected a dict, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**value)
