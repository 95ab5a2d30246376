"""Loading checkpoints as pooling models (``runner="pooling"``).

* ``XxxForSequenceClassification`` -> the matching ``XxxForCausalLM`` body; its ``score``
  linear head (``score.weight`` [+ ``score.bias``]) is split off the weight stream and given
  to the pooler.
* A bare base model (``Gemma3TextModel``, ``LlamaModel``, ...: tensor names without the
  ``model.`` prefix, no LM head) -> the matching ``XxxForCausalLM`` body.
* No LM head is needed: ``lm_head`` is dropped from the model (and from the checkpoint stream).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

SEQ_CLS_SUFFIX = "ForSequenceClassification"
HEAD_TENSORS = ("score.weight", "score.bias")


def pooling_architectures(architectures: list[str]) -> list[str]:
    """Causal-LM class names to try for ``architectures`` in pooling mode (originals kept)."""
    out: list[str] = []
    for a in architectures or []:
        if a.endswith(SEQ_CLS_SUFFIX):
            out.append(a[: -len(SEQ_CLS_SUFFIX)] + "ForCausalLM")
        elif a.endswith("TextModel"):
            out.append(a[: -len("TextModel")] + "ForCausalLM")
        elif a.endswith("Model") and not a.endswith("ForCausalLM"):
            out.append(a[: -len("Model")] + "ForCausalLM")
        out.append(a)
    return out


def drop_lm_head(model: torch.nn.Module) -> None:
    """Free an untied LM head: a pooling model never computes logits."""
    if getattr(model, "lm_head", None) is not None:
        model.lm_head = None


def split_head_weights(weights: Iterable[tuple[str, torch.Tensor]], sink: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint's tensors except the classifier head, which goes to ``sink``
    (``sink["weight"]``, ``sink["bias"]``)."""
    for name, t in weights:
        short = name[len("model."):] if name.startswith("model.score.") else name
        if short in HEAD_TENSORS:
            sink[short.split(".")[-1]] = t.detach().float().clone()
            continue
        yield name, t
