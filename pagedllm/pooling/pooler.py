"""Pooling over chunked prefills: LAST / MEAN / CLS / ALL, normalize, classifier heads.

All pooling math runs in float32 on hidden states taken after the model's final norm
(what HF returns as ``model.model(ids).last_hidden_state``).

Tasks (vLLM's names): a model loaded with ``convert="embed"`` serves ``embed`` (Matryoshka
``dimensions``, then L2 normalisation), ``token_embed`` (the same for every token's hidden
state) and ``encode`` (the raw pooled hidden state); one loaded with ``convert="classify"``
serves ``classify`` (classifier, then softmax, or sigmoid for one label), ``score`` (the same,
for cross-encoder pairs), ``token_classify`` (the classifier on every token) and ``encode``
(raw logits). ``LLM.score`` on an embed model is the cosine similarity of two ``embed``
outputs, computed by the caller.

Activation (vLLM >= 0.11): ``use_activation`` (request, else PoolerConfig, else True) is the one
switch for the output activation of every task: the normalisation of embed / token_embed and
the softmax / sigmoid of classify / score / token_classify. ``use_activation=False`` returns the
raw vector (embed: the final-normed hidden state, truncated to ``dimensions``) or raw logits.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.pooling.config import PoolerConfig

EMBED_TASKS = ("embed", "token_embed", "encode")
CLASSIFY_TASKS = ("classify", "score", "token_classify", "encode")
# Per-token tasks pool every token (ALL), whatever the configured pooling_type.
TOKEN_TASKS = ("token_embed", "token_classify")


class Pooler:
    """Accumulates a request's hidden states across prefill chunks and finishes its output.

    Args:
        config: PoolerConfig (pooling_type defaults to LAST).
        task: "embed" or "classify" (the model's conversion).
        score_weight: float32 ``[num_labels, hidden]`` classifier head (classify only), with an
            optional bias ``[num_labels]``.
        hidden_size: the model's hidden size (checks ``dimensions``).
        id2label: label names of a classifier (``hf_config.id2label``).
        is_matryoshka: the model was trained for Matryoshka truncation (HF config
            ``is_matryoshka`` / ``matryoshka_dimensions``, as vLLM reads them); None = unknown
            (``dimensions`` not checked against it).
        matryoshka_dimensions: the sizes a Matryoshka model supports (None = any).
        model_name: the model's name in error messages.
    """

    def __init__(self, config: PoolerConfig, task: str, score_weight: Optional[torch.Tensor] = None,
                 score_bias: Optional[torch.Tensor] = None, hidden_size: Optional[int] = None,
                 id2label: Optional[dict] = None, is_matryoshka: Optional[bool] = None,
                 matryoshka_dimensions: Optional[list] = None, model_name: str = "model") -> None:
        if task not in ("embed", "classify"):
            raise ValueError(f"convert: must be 'embed' or 'classify', got {task!r}")
        if task == "classify" and score_weight is None:
            raise ValueError("convert='classify' needs a classifier head: the checkpoint has no "
                             "'score.weight' tensor (a *ForSequenceClassification checkpoint)")
        self.config = config
        self.pooling_type = config.pooling_type or "LAST"
        self.task = task
        self.hidden_size = hidden_size
        self.score_weight = None if score_weight is None else score_weight.float()
        self.score_bias = None if score_bias is None else score_bias.float()
        self.num_labels = None if score_weight is None else int(score_weight.shape[0])
        self.id2label = dict(id2label or {})
        self.is_matryoshka = is_matryoshka
        self.matryoshka_dimensions = list(matryoshka_dimensions) if matryoshka_dimensions else None
        self.model_name = model_name

    # ------------------------------------------------------------------ requests
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return EMBED_TASKS if self.task == "embed" else CLASSIFY_TASKS

    def label(self, index: int) -> str:
        """Label name of class ``index`` (``id2label``; ``LABEL_i`` when unnamed)."""
        return str(self.id2label.get(index, self.id2label.get(str(index), f"LABEL_{index}")))

    def prepare_params(self, params: Any, task: str) -> Any:
        """A verified copy of ``params`` (PoolingParams or None) for ``task``, with the
        PoolerConfig defaults filled in (``use_activation``, ``dimensions``) where the task
        takes them (vLLM ``PoolingParams._merge_default_parameters``).

        Raises:
            ValueError: the model does not serve ``task`` (the message says what it serves), a
                parameter the task does not take, or a ``dimensions`` the model cannot give
                (not Matryoshka-trained, not one of its sizes, or over the hidden size).
        """
        from pagedllm.pooling_params import VALID_PARAMETERS, PoolingParams

        if task not in self.supported_tasks:
            what = {"embed": "embeddings", "classify": "classification", "score": "cross-encoder scoring",
                    "encode": "encode", "token_embed": "token embeddings",
                    "token_classify": "token classification"}.get(task, task)
            raise ValueError(
                f"this model was loaded with convert={self.task!r} and does not support {what} "
                f"(task {task!r}); it supports {list(self.supported_tasks)}")
        p = PoolingParams() if params is None else params.clone()
        cfg = self.config
        for name in VALID_PARAMETERS[task]:
            if getattr(p, name) is None and getattr(cfg, name, None) is not None:
                setattr(p, name, getattr(cfg, name))
        p.verify(task, hidden_size=self.hidden_size, is_matryoshka=self.is_matryoshka,
                 matryoshka_dimensions=self.matryoshka_dimensions, model_name=self.model_name)
        if task == "score" and self.num_labels != 1:
            raise ValueError(f"score: cross-encoder scoring needs a classifier with 1 label; this model "
                             f"has num_labels={self.num_labels} (use classify)")
        return p

    # ------------------------------------------------------------------ runner side
    def accumulate(self, state: dict, r: Any, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Fold one chunk into ``state[r.req_id]``; on the last chunk return the finished output.

        Args:
            state: the runner's per-request pooling state (dict, mutated).
            r: the ScheduledRequest (``start_pos``, ``is_last_chunk``, ``pooling_params``).
            hidden: ``[num_tokens, hidden]`` hidden states of this chunk (any float dtype).

        Returns:
            float32 tensor on CPU when ``r.is_last_chunk`` (``[hidden]`` or ``[dims]`` for embed,
            ``[num_labels]`` for classify, ``[T, ...]`` for ALL), else None.
        """
        h = hidden.float()
        task = getattr(r.pooling_params, "task", None)
        pt = "ALL" if task in TOKEN_TASKS else self.pooling_type
        st = state.get(r.req_id)
        if pt == "MEAN":
            s = h.sum(dim=0)
            st = (s, h.shape[0]) if st is None else (st[0] + s, st[1] + h.shape[0])
        elif pt == "CLS":
            if r.start_pos == 0:
                st = h[0].clone()
        elif pt == "ALL":
            st = [h.clone()] if st is None else st + [h.clone()]
        if st is not None:
            state[r.req_id] = st
        if not r.is_last_chunk:
            return None
        if pt == "LAST":
            pooled = h[-1]
        elif pt == "MEAN":
            pooled = st[0] / st[1]
        elif pt == "CLS":
            if st is None:
                raise RuntimeError(f"CLS pooling: request {r.req_id} never computed its first token")
            pooled = st
        else:
            pooled = torch.cat(st, dim=0)
        state.pop(r.req_id, None)
        return self.head(pooled, r.pooling_params).cpu()

    def head(self, pooled: torch.Tensor, params: Any) -> torch.Tensor:
        """Apply the task head to float32 ``pooled`` (``[hidden]``, or ``[T, hidden]`` for ALL /
        token tasks): classifier, then softmax / sigmoid (classify model), or Matryoshka
        truncation, then L2 normalisation (embed model), the activation only when
        ``use_activation`` (request, else config, else True); nothing for encode."""
        task = getattr(params, "task", None) or self.task
        use_act = _first(getattr(params, "use_activation", None), self.config.use_activation, True)
        if self.task == "classify":
            if self.score_weight.device != pooled.device:  # e.g. hidden states on CUDA
                self.score_weight = self.score_weight.to(pooled.device)
                self.score_bias = None if self.score_bias is None else self.score_bias.to(pooled.device)
            logits = F.linear(pooled, self.score_weight, self.score_bias)
            if task == "encode" or not use_act:
                return logits
            return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        if task == "encode":
            return pooled
        dims = _first(getattr(params, "dimensions", None), self.config.dimensions, None)
        if dims is not None:
            if dims > pooled.shape[-1]:
                raise ValueError(f"dimensions: {dims} exceeds the embedding size {pooled.shape[-1]}")
            pooled = pooled[..., :dims]
        if use_act:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled


def _first(*vals):
    for v in vals:
        if v is not None:
            return v
    return None


def build_pooler(args: Any, hf_config: Any, model: Any, score_weight: Optional[torch.Tensor] = None,
                 score_bias: Optional[torch.Tensor] = None) -> Pooler:
    """The pooler for ``runner="pooling"`` (``convert`` = "embed" unless the checkpoint is a classifier).

    Raises:
        ValueError: bad pooler_config / convert, or convert="classify" without a classifier head.
    """
    cfg = PoolerConfig.from_any(args.pooler_config)
    task = args.convert or ("classify" if score_weight is not None else "embed")
    if task not in ("embed", "classify"):
        raise ValueError(f"convert: must be 'embed' or 'classify', got {task!r}")
    id2label = getattr(hf_config, "id2label", None) if score_weight is not None else None
    ov = getattr(args, "hf_overrides", None)
    if isinstance(ov, str):
        from pagedllm.config import parse_json_arg
        ov = parse_json_arg(ov, "hf_overrides", "a dict")
    asked = isinstance(ov, dict) and ("num_labels" in ov or "id2label" in ov)  # (a callable: not checked)
    want = getattr(hf_config, "num_labels", None) if asked else None
    if score_weight is not None and want and int(want) != int(score_weight.shape[0]):
        # vLLM fails loading the head then (a shape mismatch); say which numbers disagree
        raise ValueError(f"num_labels: the config says {want} labels (hf_overrides?) but the checkpoint's "
                         f"classifier head has {int(score_weight.shape[0])} rows")
    # vLLM ModelConfig.is_matryoshka / .matryoshka_dimensions read the same two HF config keys.
    mdims = getattr(hf_config, "matryoshka_dimensions", None)
    is_matryoshka = bool(mdims) or bool(getattr(hf_config, "is_matryoshka", False))
    names = getattr(args, "served_model_name", None)
    name = (names if isinstance(names, str) else (names or [None])[0]) or str(getattr(args, "model", "model"))
    return Pooler(cfg, task, score_weight, score_bias,
                  hidden_size=int(getattr(hf_config, "hidden_size", 0) or 0) or None, id2label=id2label,
                  is_matryoshka=is_matryoshka, matryoshka_dimensions=list(mdims) if mdims else None,
                  model_name=name)
