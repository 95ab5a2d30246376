"""Per-request pooling parameters, with vLLM's names (``vllm.pooling_params``).

``use_activation`` is the one switch for a pooler's output activation, for every task
(vLLM >= 0.11): the L2 normalisation of ``embed`` / ``token_embed`` outputs, the softmax (or
sigmoid for one label) of ``classify`` / ``score`` / ``token_classify`` outputs. ``normalize``,
``softmax`` and ``activation`` survive as deprecated aliases of it (a warning is logged once
per alias and process, as vLLM's ``get_use_activation`` does).

Pure Python (no torch).
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Optional, Sequence

logger = logging.getLogger("pagedllm")

# Which parameters each pooling task accepts (vLLM ``PoolingParams.valid_parameters``; "encode"
# is the raw pooled hidden state / raw logits: nothing to switch).
VALID_PARAMETERS: dict[str, list[str]] = {
    "embed": ["dimensions", "use_activation"],
    "classify": ["use_activation"],
    "score": ["use_activation"],
    "encode": [],
    "token_embed": ["dimensions", "use_activation"],
    "token_classify": ["use_activation"],
}
_ALL_PARAMETERS = ("dimensions", "use_activation")
POOLING_TASKS = tuple(VALID_PARAMETERS)
# Deprecated names of ``use_activation`` (vLLM's order of precedence).
DEPRECATED_ACTIVATION_ALIASES = ("normalize", "softmax", "activation")
_warned_aliases: set[str] = set()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_use_activation(use_activation: Optional[bool], where: str = "",
                           **aliases: Optional[bool]) -> Optional[bool]:
    """``use_activation`` after folding in its deprecated aliases (``normalize``, ``softmax``,
    ``activation``): the first alias that is set wins when ``use_activation`` is None; each alias
    used logs a deprecation warning once per process (vLLM ``config.pooler.get_use_activation``).

    Args:
        use_activation: the value given under the current name (None = unset).
        where: prefix for error messages (e.g. "pooler_config.").
        **aliases: alias name -> value (None = unset).

    Returns:
        the resolved value (None when nothing was set).

    Raises:
        ValueError: a non-bool value, or an alias contradicting ``use_activation`` or another
            alias (vLLM silently lets the alias win; a contradiction is a caller bug here).
    """
    value = use_activation
    source = "use_activation"
    unknown = set(aliases) - set(DEPRECATED_ACTIVATION_ALIASES)
    if unknown:
        raise TypeError(f"resolve_use_activation: unknown alias(es) {sorted(unknown)}")
    for name in DEPRECATED_ACTIVATION_ALIASES:
        alias = aliases.get(name)
        if alias is None:
            continue
        if not isinstance(alias, bool):
            raise ValueError(f"{where}{name} must be a bool or None, got {alias!r}.")
        if name not in _warned_aliases:
            _warned_aliases.add(name)
            logger.warning("`%s` is deprecated; it is an alias of `use_activation`. Please use "
                           "`use_activation` instead.", name)
        if value is not None and value != alias:
            raise ValueError(
                f"{where}{name} is a deprecated alias of use_activation; got conflicting values "
                f"{source}={value}, {name}={alias}.")
        if value is None:
            value, source = alias, name
    return value


def _activation_alias(name: str) -> property:
    """A deprecated alias of ``PoolingParams.use_activation``: reads it, and sets it through
    ``resolve_use_activation`` (which logs the deprecation warning once per alias)."""

    def get(self: "PoolingParams") -> Optional[bool]:
        return self.use_activation

    def set_(self: "PoolingParams", value: Optional[bool]) -> None:
        self.use_activation = resolve_use_activation(None, **{name: value})

    return property(get, set_, doc=f"Deprecated alias of ``use_activation`` ({name}).")


class PoolingParams:
    """Parameters of one pooling (embedding / classification / scoring) request.

    Attributes:
        dimensions: truncate embeddings to their first ``dimensions`` values (Matryoshka
            models only), >= 1; None = full size.
        use_activation: apply the task's output activation: L2 normalisation for embed /
            token_embed, softmax (sigmoid for one label) for classify / score / token_classify;
            None = the PoolerConfig's value, else True. ``normalize``, ``softmax`` and
            ``activation`` are deprecated aliases (constructor keywords and properties).
        truncate_prompt_tokens: keep only the last k prompt tokens (>= 1), -1 = up to
            max_model_len, None = no truncation.
        task: "embed", "classify", "score", "encode", "token_embed", "token_classify", or None
            until the engine sets it (see :meth:`verify`).
        extra_kwargs: free-form dict for extensions, not interpreted.

    Raises:
        ValueError: a field of the wrong type or range, or contradicting aliases.
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
        softmax: Optional[bool] = None,
        activation: Optional[bool] = None,
    ) -> None:
        if use_activation is not None and not isinstance(use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {use_activation!r}.")
        self.use_activation = resolve_use_activation(
            use_activation, normalize=normalize, softmax=softmax, activation=activation)
        self.dimensions = dimensions
        self.truncate_prompt_tokens = truncate_prompt_tokens
        self.task = task
        self.extra_kwargs = extra_kwargs
        self._verify_args()

    # Deprecated aliases of ``use_activation`` (vLLM's older names).
    normalize = _activation_alias("normalize")
    activation = _activation_alias("activation")
    softmax = _activation_alias("softmax")

    def _verify_args(self) -> None:
        if self.dimensions is not None:
            if not _is_int(self.dimensions):
                raise ValueError(
                    f"dimensions must be an int or None, got {type(self.dimensions).__name__}.")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r}.")
        if self.truncate_prompt_tokens is not None:
            t = self.truncate_prompt_tokens
            if not _is_int(t) or not (t >= 1 or t == -1):
                raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {t}.")
        if self.task is not None and self.task not in VALID_PARAMETERS:
            raise ValueError(
                f"task must be one of {sorted(VALID_PARAMETERS)}, got {self.task!r}.")
        if self.extra_kwargs is not None and not isinstance(self.extra_kwargs, dict):
            raise ValueError("extra_kwargs must be a dict or None.")

    def verify(
        self,
        task: Optional[str] = None,
        *,
        hidden_size: Optional[int] = None,
        is_matryoshka: Optional[bool] = None,
        matryoshka_dimensions: Optional[Sequence[int]] = None,
        model_name: str = "model",
    ) -> None:
        """Engine-side check once the task and model are known (vLLM ``verify``).

        Sets ``task`` (if given), rejects parameters the task does not take, checks
        ``dimensions`` against the model and fills the default ``use_activation=True``.

        Args:
            task: the pooling task.
            hidden_size: the model's embedding size (``dimensions`` may not exceed it).
            is_matryoshka: whether the model was trained for Matryoshka truncation (HF config
                ``is_matryoshka`` or ``matryoshka_dimensions``); None = unknown, not checked.
            matryoshka_dimensions: the only sizes the model supports, when its config lists them.
            model_name: the name used in error messages.

        Raises:
            ValueError: a task mismatch, a parameter the task does not take, or ``dimensions``
                on a model that is not Matryoshka-trained / not among its sizes / too large.
        """
        if task is not None:
            if self.task is not None and self.task != task:
                raise ValueError(
                    f"task must be {task!r} for this model, got {self.task!r}.")
            self.task = task
        self._verify_args()
        if self.task is None:
            return
        valid = VALID_PARAMETERS[self.task]
        invalid = [p for p in _ALL_PARAMETERS
                   if getattr(self, p) is not None and p not in valid]
        if invalid:
            raise ValueError(
                f"Task {self.task} only supports {valid} parameters, does not support "
                f"{invalid} parameters.")
        if self.dimensions is not None:
            if is_matryoshka is False:
                raise ValueError(
                    f'dimensions: model "{model_name}" does not support matryoshka representation, '
                    "changing output dimensions will lead to poor results.")
            if matryoshka_dimensions and self.dimensions not in matryoshka_dimensions:
                raise ValueError(
                    f'dimensions: model "{model_name}" only supports {list(matryoshka_dimensions)} '
                    f"matryoshka dimensions, got {self.dimensions}; other output dimensions will lead "
                    "to poor results.")
            if hidden_size is not None and self.dimensions > hidden_size:
                raise ValueError(
                    f"dimensions must be <= the model's embedding size {hidden_size}, "
                    f"got {self.dimensions}.")
        if "use_activation" in valid and self.use_activation is None:
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
            f"use_activation={self.use_activation}, "
            f"truncate_prompt_tokens={self.truncate_prompt_tokens}, "
            f"extra_kwargs={self.extra_kwargs})")
