"""Pooling over chunked prefills: LAST / MEAN / CLS / ALL, normalize, classifier heads.

All pooling math runs in float32 on hidden states taken after the model's final norm.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.pooling.config import PoolerConfig


class Pooler:
    """Accumulates a request's hidden states across prefill chunks and finishes its output.

    Args:
        config: PoolerConfig (pooling_type defaults to LAST).
        task: "embed" or "classify".
        score_weight: float32 ``[num_labels, hidden]`` classifier head (classify only), with an
            optional bias ``[num_labels]``.
    """

    def __init__(self, config: PoolerConfig, task: str, score_weight: Optional[torch.Tensor] = None,
                 score_bias: Optional[torch.Tensor] = None) -> None:
        self.config = config
        self.pooling_type = config.pooling_type or "LAST"
        self.task = task
        self.score_weight = None if score_weight is None else score_weight.float()
        self.score_bias = None if score_bias is None else score_bias.float()

    def accumulate(self, state: dict, r: Any, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Fold one chunk into ``state[r.req_id]``; on the last chunk return the finished output.

        Args:
            state: the runner's per-request pooling state (dict, mutated).
            r: the ScheduledRequest (``start_pos``, ``is_last_chunk``, ``pooling_params``).
            hidden: ``[num_tokens, hidden]`` hidden states of this chunk (any float dtype).

        Returns:
            float32 tensor on CPU when ``r.is_last_chunk`` (``[hidden]`` or ``[dims]`` for embed,
            ``[num_labels]`` for classify, ``[T, hidden]`` for ALL), else None.
        """
        h = hidden.float()
        pt = self.pooling_type
        st = state.get(r.req_id)
        if pt == "MEAN":
            s = h.sum(dim=0)
            st = (s, h.shape[0]) if st is None else (st[0] + s, st[1] + h.shape[0])
        elif pt == "CLS":
            if r.start_pos == 0:
                st = h[0].clone()
        elif pt == "ALL":
            st = [h.clone()] if st is None else st + [h.clone()]
        state[r.req_id] = st
        if not r.is_last_chunk:
            return None
        if pt == "LAST":
            pooled = h[-1]
        elif pt == "MEAN":
            pooled = st[0] / st[1]
        elif pt == "CLS":
            pooled = st
        else:
            pooled = torch.cat(st, dim=0)
        state.pop(r.req_id, None)
        return self.head(pooled, r.pooling_params).cpu()

    def head(self, pooled: torch.Tensor, params: Any) -> torch.Tensor:
        """Apply the task head: normalize / Matryoshka truncation (embed) or classifier + activation."""
        if self.task == "classify":
            if self.score_weight is None:
                raise ValueError("convert='classify' needs a classifier head (score.weight) in the checkpoint")
            logits = F.linear(pooled, self.score_weight, self.score_bias)
            use_act = _first(getattr(params, "use_activation", None), self.config.use_activation, True)
            if not use_act:
                return logits
            return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        dims = _first(getattr(params, "dimensions", None), self.config.dimensions, None)
        if dims is not None:
            if dims > pooled.shape[-1]:
                raise ValueError(f"dimensions: {dims} exceeds the embedding size {pooled.shape[-1]}")
            pooled = pooled[..., :dims]
        normalize = _first(getattr(params, "normalize", None), self.config.normalize, True)
        if normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled


def _first(*vals):
    for v in vals:
        if v is not None:
            return v
    return None


def build_pooler(args: Any, hf_config: Any, model: Any, score_weight: Optional[torch.Tensor] = None,
                 score_bias: Optional[torch.Tensor] = None) -> Pooler:
    """The pooler for ``runner="pooling"`` (``convert`` = "embed" unless the checkpoint is a classifier)."""
    cfg = PoolerConfig.from_any(args.pooler_config)
    task = args.convert or ("classify" if score_weight is not None else "embed")
    if task not in ("embed", "classify"):
        raise ValueError(f"convert: must be 'embed' or 'classify', got {task!r}")
    return Pooler(cfg, task, score_weight, score_bias)
