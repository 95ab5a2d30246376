"""Rotary embeddings from a config's ``rope_parameters``: every rope type transformers 5 knows for
decoder LMs (default, linear, dynamic, yarn, llama3, longrope), partial rotary, per-layer-type ropes.

The static types (default, linear, yarn, llama3) are one set of inverse frequencies plus a cos/sin
scaling, computed by transformers' own ``ROPE_INIT_FUNCTIONS`` (``layers.rope_inv_freq``).

Two types depend on the sequence length, which transformers evaluates once per forward from the
longest position in it (``modeling_rope_utils.dynamic_rope_update``); a paged engine batches
unrelated requests and keeps keys in its cache, so each needs a rule that does not depend on the batch:

- ``longrope`` (Phi-3, transformers ``_compute_longrope_parameters``): vLLM's rule: the long factors
  for every position when the engine's ``max_model_len`` exceeds ``original_max_position_embeddings``
  (``set_rope_max_model_len``; before that, ``max_position_embeddings`` stands in for it), else the
  short ones; one attention factor. transformers' Phi-3 ``generate`` recomputes its whole cache with
  the long factors once a sequence passes the original length, so the two agree on any sequence
  longer than that, and on shorter ones when ``max_model_len`` is at most the original length.
- ``dynamic`` (NTK-aware, transformers ``_compute_dynamic_ntk_parameters``): per token: a token at
  position ``p`` is rotated with the base for a sequence of length ``L = max(p + 1, M)``
  (``M`` = ``max_position_embeddings``): ``base_L = base * (factor * L / M - (factor - 1)) ** (R / (R - 2))``.
  That is exactly what transformers computes generating with its cache (one token per step, the base
  growing with the sequence), and its prefill of any prompt within ``M``; it differs only inside one
  long prefill past ``M`` (transformers then rotates the prompt's early tokens with the larger base
  too). vLLM instead fixes the base at ``L = factor * M`` for every position.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.models.layers import RotaryEmbedding, rope_inv_freq


def _rope_params(config, layer_type: Optional[str]) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return params


def _hf_config(config):
    """A transformers config for transformers' rope functions (a GGUF ``TextConfig`` converted)."""
    to_tf = getattr(config, "to_transformers", None)
    return to_tf() if to_tf is not None else config


def make_rotary(config, head_dim: int, layer_type: Optional[str] = None) -> RotaryEmbedding:
    """The ``RotaryEmbedding`` a layer of ``config`` (of ``layer_type``, for per-type ropes) uses.

    Args:
        config: a transformers config (or ``loader.text_config.TextConfig``).
        head_dim: D; the rotated dims are ``int(D * partial_rotary_factor)``.
        layer_type: "sliding_attention" / "full_attention" when ``rope_parameters`` is keyed by
            layer type (Gemma 2/3), else None.

    Raises:
        NotImplementedError: a rope type transformers does not define for these models.
    """
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":  # NOTE: no transformers import for a GGUF model's TextConfig
        return RotaryEmbedding(head_dim, *rope_inv_freq(config, head_dim, layer_type))
    if rope_type not in ("dynamic", "longrope"):
        return RotaryEmbedding(head_dim, *rope_inv_freq(_hf_config(config), head_dim, layer_type))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf_config(config)
    kwargs = {"layer_type": layer_type} if layer_type in (getattr(cfg, "rope_parameters", None) or {}) else {}
    init = ROPE_INIT_FUNCTIONS[rope_type]
    short, scaling = init(cfg, None, **kwargs)
    short = short.float()
    if rope_type == "longrope":
        orig = int(_rope_params(cfg, layer_type)["original_max_position_embeddings"])
        long, _ = init(cfg, None, seq_len=orig + 1, **kwargs)
        rotary = RotaryEmbedding(head_dim, short, float(scaling))
        rotary.long_rope = (short, long.float(), orig)
        set_rotary_max_model_len(rotary, int(cfg.max_position_embeddings))
        return rotary
    base = float(_rope_params(cfg, layer_type)["rope_theta"])
    factor = float(_rope_params(cfg, layer_type)["factor"])
    m = int(cfg.max_position_embeddings)
    dim = 2 * short.numel()
    expo = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def rows(n: int) -> torch.Tensor:
        out = short.expand(n, -1).clone()
        if n > m:
            seq = torch.arange(m + 1, n + 1, dtype=torch.float32)  # L = p + 1 for rows p >= M
            b = base * ((factor * seq / m) - (factor - 1)) ** (dim / (dim - 2))
            out[m:] = 1.0 / (b.unsqueeze(1) ** expo.unsqueeze(0))
        return out
    return RotaryEmbedding(head_dim, short, float(scaling), row_inv_freq=rows)


def set_rotary_max_model_len(rotary: RotaryEmbedding, max_model_len: int) -> None:
    """Pick a longrope rotary's factors for an engine serving up to ``max_model_len`` tokens (vLLM's
    rule, see the module doc); other ropes are left alone."""
    long_rope = getattr(rotary, "long_rope", None)
    if long_rope is None:
        return
    short, long, orig = long_rope
    inv_freq = long if max_model_len > orig else short
    if not torch.equal(inv_freq, rotary.inv_freq):
        rotary.inv_freq = inv_freq
        rotary.drop_table()  # NOTE: an empty table is rebuilt (on its device) on the next use
        rotary._checked_positions = None
        if rotary._reserved:
            rotary.reserve(rotary._reserved, rotary._table_device)


def set_rope_max_model_len(model, max_model_len: int) -> int:
    """``set_rotary_max_model_len`` on every rope of ``model`` (shared ropes are reached through the
    attention blocks); returns how many longrope rotaries were set."""
    seen: dict[int, RotaryEmbedding] = {}
    for m in model.modules():
        r = getattr(m, "rotary", None)
        for cand in (r.values() if isinstance(r, dict) else r if isinstance(r, (list, tuple)) else [r]):
            if isinstance(cand, RotaryEmbedding) and getattr(cand, "long_rope", None) is not None:
                seen[id(cand)] = cand
    for r in seen.values():
        set_rotary_max_model_len(r, max_model_len)
    return len(seen)
