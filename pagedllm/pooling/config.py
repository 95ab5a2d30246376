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
        use_activation: the output activation of every task (vLLM's one switch): L2
            normalisation for embed / token_embed, softmax (sigmoid for one label) for classify /
            score / token_classify. None = True. A request's own ``use_activation`` wins.
        dimensions: default Matryoshka truncation for embeddings.
        normalize, softmax, activation: deprecated aliases of ``use_activation`` (folded into it
            with a warning, then reset to None).

    Raises:
        ValueError: unknown pooling_type, a bad dimensions, or contradicting aliases.
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
        from pagedllm.pooling_params import resolve_use_activation

        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"pooler_config.use_activation: must be a bool, got {self.use_activation!r}")
        self.use_activation = resolve_use_activation(
            self.use_activation, "pooler_config.", normalize=self.normalize, softmax=self.softmax,
            activation=self.activation)
        self.normalize = self.softmax = self.activation = None
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config.dimensions: must be >= 1, got {self.dimensions}")

    @classmethod
    def from_any(cls, value) -> "PoolerConfig":
        """Build from None, a dict, a JSON string or a PoolerConfig.

        Raises:
            ValueError: bad JSON or unknown keys.
        """
        import dataclasses

        from pagedllm.config import dataclass_from_json

        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        return dataclass_from_json(cls, value, "pooler_config")
