"""Per-request pooling parameters, with vLLM's names (``vllm.pooling_params``).

Pure Python (no torch).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

# Which parameters each pooling task accepts (vLLM ``PoolingParams.valid_parameters``).
_VALID_PARAMETERS: dict[str, list[str]] = {
    "embed": ["dimensions", "normalize"],
    "classify": ["use_activation"],
    "score": ["use_activation"],
    "encode": [],
    "token_embed": ["dimensions", "normalize"],
    "token_classify": ["use_activation"],
}
_ALL_PARAMETERS = ("dimensions", "normalize", "use_activation")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class PoolingParams:
    """Parameters of one pooling (embedding / classification / scoring) request.

    Attributes:
        dimensions: truncate the embedding to its first ``dimensions`` values (Matryoshka
            models), >= 1; None = full size.
        normalize: L2-normalize embeddings (None = task default: True for embed).
        use_activation: apply the classifier's activation (sigmoid/softmax) (None = task
            default: True for classify/score). ``activation`` is accepted as an alias.
        truncate_prompt_tokens: keep only the last k prompt tokens (>= 1), -1 = up to
            max_model_len, None = no truncation.
        task: "embed", "classify", "score", "encode", "token_embed", "token_classify",
            or None until the engine sets it (see :meth:`verify`).
        extra_kwargs: free-form dict for extensions, not interpreted.
    """

    def __init__(
        self,
        dimensions: Optional[int] = None,
        normalize: Optional[bool] = None,
        use_activation: Optional[bool] = None,
        truncate_prompt_tokens: Optional[int] = None,
        task: Optional[str] = None,
        extra_kwargs: Optional[dict[str, Any]] = None,
        *,
        activation: Optional[bool] = None,
    ) -> None:
        if activation is not None:
            if use_activation is not None and use_activation != activation:
                raise ValueError(
                    "activation is an alias of use_activation; got conflicting values "
                    f"use_activation={use_activation}, activation={activation}.")
            use_activation = activation
        self.dimensions = dimensions
        self.normalize = normalize
        self.use_activation = use_activation
        self.truncate_prompt_tokens = truncate_prompt_tokens
        self.task = task
        self.extra_kwargs = extra_kwargs
        self._verify_args()

    # ``activation`` alias (older vLLM name).
    @property
    def activation(self) -> Optional[bool]:
        return self.use_activation

    @activation.setter
    def activation(self, value: Optional[bool]) -> None:
        self.use_activation = value

    def _verify_args(self) -> None:
        if self.dimensions is not None:
            if not _is_int(self.dimensions):
                raise ValueError(
                    f"dimensions must be an int or None, got {type(self.dimensions).__name__}.")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        for name in ("normalize", "use_activation"):
            val = getattr(self, name)
            if val is not None and not isinstance(val, bool):
                raise ValueError(f"{name} must be a bool or None, got {val!r}.")
        if self.truncate_prompt_tokens is not None:
            t = self.truncate_prompt_tokens
            if not _is_int(t) or not (t >= 1 or t == -1):
                raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {t}.")
        if self.task is not None and self.task not in _VALID_PARAMETERS:
            raise ValueError(
                f"task must be one of {sorted(_VALID_PARAMETERS)}, got {self.task!r}.")
        if self.extra_kwargs is not None and not isinstance(self.extra_kwargs, dict):
            raise ValueError("extra_kwargs must be a dict or None.")

    def verify(
        self,
        task: Optional[str] = None,
        *,
        hidden_size: Optional[int] = None,
        is_matryoshka: bool = True,
    ) -> None:
        """Engine-side check once the task and model are known (vLLM ``verify``).

        Sets ``task`` (if given), rejects parameters the task does not support, checks
        ``dimensions`` against the model (``is_matryoshka``, ``hidden_size``) and fills the
        task defaults (``normalize=True`` for embeddings, ``use_activation=True`` for
        classify/score).
        """
        if task is not None:
            if self.task is not None and self.task != task:
                raise ValueError(
                    f"task must be {task!r} for this model, got {self.task!r}.")
            self.task = task
        self._verify_args()
        if self.task is None:
            return
        valid = _VALID_PARAMETERS[self.task]
        invalid = [p for p in _ALL_PARAMETERS
                   if getattr(self, p) is not None and p not in valid]
        if invalid:
            raise ValueError(
                f"Task {self.task} only supports {valid} parameters, does not support "
                f"{invalid} parameters.")
        if self.dimensions is not None:
            if not is_matryoshka:
                raise ValueError(
                    "dimensions: model does not support matryoshka representation, "
                    "changing output dimensions will lead to poor results.")
            if hidden_size is not None and self.dimensions > hidden_size:
                raise ValueError(
                    f"dimensions must be <= the model's embedding size {hidden_size}, "
                    f"got {self.dimensions}.")
        if self.task in ("embed", "token_embed") and self.normalize is None:
            self.normalize = True
        if self.task in ("classify", "score", "token_classify") and self.use_activation is None:
            self.use_activation = True

    def clone(self) -> "PoolingParams":
        return copy.deepcopy(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PoolingParams):
            return NotImplemented
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        return (
            f"PoolingParams(task={self.task!r}, dimensions={self.dimensions}, "
            f"normalize={self.normalize}, use_activation={self.use_activation}, "
            f"truncate_prompt_tokens={self.truncate_prompt_tokens}, "
            f"extra_kwargs={self.extra_kwargs})")
