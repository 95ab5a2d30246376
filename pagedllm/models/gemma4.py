"""Gemma 4 (text decoder): HF ``Gemma4ForCausalLM`` and the text part of
``Gemma4ForConditionalGeneration`` (transformers >= 5.24, ``model_type`` ``gemma4_text`` / ``gemma4``).

What Gemma 4 text has that Gemma 3 lacks, and how it is served here:

- **Plain RMSNorms** (``w * normed``, weights start at 1; Gemma 3 multiplies by ``1 + w``), a
  scale-free ``v_norm`` on the values, q/k norms, softmax scale 1.0 (no ``query_pre_attn_scalar``).
- **Per-layer head shapes** (``config.per_layer_config``): full-attention layers use
  ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` key heads whose
  projection also gives the values (no ``v_proj``). The engine's KV cache has one shape for every
  layer, so it is sized to the largest ``(Hkv, D)``; a smaller layer zero-pads its head dim (q and k
  padded with zeros leave every dot product unchanged, the padded output columns are dropped) and
  repeats its KV heads (the query -> KV-head grouping is unchanged). Exact, at the price of cache
  memory for the smaller layers.
- **KV sharing** (``num_kv_shared_layers``): the last layers have no k/v projections and attend
  over the keys/values of the last earlier layer of the same attention type (HF ``kv_sharing_modes``:
  "store" -> "reuse"). Here a reusing layer reads the producer's paged cache (its ``layer_idx``) and
  re-writes the producer's own keys/values of this step into it (identical data, so the write is a
  no-op in effect; the attention backends need no Q-only mode). Only the non-shared layers get a KV
  cache: ``get_kv_cache_spec`` reports ``num_hidden_layers - num_kv_shared_layers`` layers.
  ``use_double_wide_mlp`` doubles the MLP width of the reusing layers, as in HF.
- **Per-layer embeddings** (PLE, ``hidden_size_per_layer_input``): a packed table
  ``embed_tokens_per_layer [vocab_size_per_layer_input, L * P]`` (scaled by ``sqrt(P)``) plus a
  projection of the token embedding (``per_layer_model_projection`` * ``H**-0.5``, then
  ``per_layer_projection_norm``), summed and scaled by ``2**-0.5``; each layer gates it in after the
  MLP (``per_layer_input_gate`` -> activation -> * its slice -> ``per_layer_projection`` ->
  ``post_per_layer_input_norm``, residual).
- ``layer_scalar`` (a checkpoint buffer) multiplies each layer's output.
- Rope per attention type from ``rope_parameters[type]`` at that type's head dim: "default" (full
  head dim, as HF's Gemma 4 rotary, which ignores ``partial_rotary_factor`` there) and transformers'
  other init functions, e.g. "proportional" (the first ``partial_rotary_factor`` of the frequency
  pairs rotate, the rest are zero: pass-through).
- ``final_logit_softcapping`` as Gemma 3.

Refused at load with a ``ValueError`` naming the field: ``enable_moe_block`` (the MoE variants),
``use_bidirectional_attention="all"``, ``num_kv_shared_layers`` covering every layer (no producer),
dynamically rescaled rope types, a per-layer head shape the padded cache cannot hold.
Prompt embeddings (``--enable-prompt-embeds``) are not supported with PLE (the per-layer table needs
the token ids): such a forward raises ``ValueError``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.models.base import CausalLM
from pagedllm.models.layers import ACTIVATIONS, Embedding, GatedMLP, Linear, PackedLinear, RMSNorm, RotaryEmbedding


def _layer_shape(config, i: int) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of layer ``i`` (``config.per_layer_config`` when present)."""
    plc = getattr(config, "per_layer_config", None)
    lc = plc[i] if plc is not None else config
    return int(lc.num_key_value_heads), int(lc.head_dim)


def kv_sharing_modes(config) -> list[Optional[str]]:
    """Per layer None (own KV), "store" (own KV, read by later layers) or "reuse" (no k/v: reads the
    last earlier layer of its type), as HF's ``Gemma4TextConfig.kv_sharing_modes``."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    n, shared = int(config.num_hidden_layers), int(getattr(config, "num_kv_shared_layers", 0) or 0)
    return [None] * (n - shared) + ["reuse"] * shared


def check_gemma4_config(config) -> None:
    """Refuse what this implementation cannot run, naming the field.

    Raises:
        ValueError: ``enable_moe_block``, ``use_bidirectional_attention == "all"``,
            ``num_kv_shared_layers`` >= ``num_hidden_layers``, ``num_attention_heads`` not a multiple
            of a layer's KV heads, or layer shapes the one-shape KV cache cannot hold.
    """
    if getattr(config, "enable_moe_block", False):
        raise ValueError("enable_moe_block: Gemma 4 mixture-of-experts layers are not supported")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("use_bidirectional_attention: 'all' (non-causal attention) is not supported")
    n, shared = int(config.num_hidden_layers), int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared >= n:
        raise ValueError(f"num_kv_shared_layers: {shared} of {n} layers leaves no layer to produce the "
                         "shared keys/values (only assistant models get them from outside)")
    hq = int(config.num_attention_heads)
    shapes = [_layer_shape(config, i) for i in range(n)]
    max_kv = max(s[0] for s in shapes)
    for i, (kv, _) in enumerate(shapes):
        if hq % kv or max_kv % kv or hq % max_kv:
            raise ValueError(f"num_key_value_heads: layer {i} has {kv} KV heads; the shared KV cache holds "
                             f"{max_kv} and needs both to divide num_attention_heads {hq}")


def gemma4_rotary(config, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """The rope of ``layer_type``'s layers (``config.rope_parameters[layer_type]``) at ``head_dim``.

    Raises:
        ValueError: no rope parameters for the type, or a dynamically rescaled type.
    """
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if not params:
        raise ValueError(f"rope_parameters: no entry for {layer_type!r}")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params["rope_theta"])
        return RotaryEmbedding(head_dim, 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)))
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_parameters: rope_type {rope_type!r} ({layer_type}) is not supported for Gemma 4")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    return RotaryEmbedding(head_dim, inv_freq.float(), float(scaling))


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale-free RMSNorm (HF ``Gemma4RMSNorm(with_scale=False)``), float32 math."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(nn.Module):
    """q (and, unless KV-reusing, k / v) projections, q/k/v norms, rope, paged attention at scale 1.

    Args:
        config: the text config; layer_idx: the layer; rotary: its type's rope.
        cache_idx: the KV cache this layer reads (its own, or the producer's when reusing).
        cache_shape: ``(Hkv, D)`` of every KV cache (the largest layer's): smaller layers pad.
        reuse: True = no k/v projections: keys/values come from the producer (``forward``'s ``shared``).
    """

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, cache_idx: int,
                 cache_shape: tuple[int, int], reuse: bool) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        sliding = self.layer_type == "sliding_attention"
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads, self.head_dim = _layer_shape(config, layer_idx)
        self.cache_kv_heads, self.cache_head_dim = cache_shape
        self.reuse, self.eps = reuse, config.rms_norm_eps
        self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and not sliding
        H, d, bias = config.hidden_size, self.head_dim, bool(config.attention_bias)
        shards = {"q": self.num_heads * d}
        if not reuse:
            shards["k"] = self.num_kv_heads * d
            if not self.k_eq_v:
                shards["v"] = self.num_kv_heads * d
        self.qkv_proj = PackedLinear(H, shards, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = None if reuse else RMSNorm(d, config.rms_norm_eps)
        self.o_proj = Linear(self.num_heads * d, H, bias=bias)
        self.rotary = [rotary]  # NOTE: a list: a shared rope is not a submodule
        self.attn = Attention(self.num_heads, self.cache_head_dim, 1.0, self.cache_kv_heads, cache_idx,
                              config.sliding_window if sliding else None, None)

    def _to_cache_shape(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, Hkv, D]`` -> ``[T, cache Hkv, cache D]``: KV heads repeated, head dim zero-padded."""
        if self.cache_kv_heads != self.num_kv_heads:
            x = x.repeat_interleave(self.cache_kv_heads // self.num_kv_heads, dim=1)
        if self.cache_head_dim != self.head_dim:
            x = F.pad(x, (0, self.cache_head_dim - self.head_dim))
        return x

    def forward(self, positions: torch.Tensor, x: torch.Tensor, shared: dict) -> torch.Tensor:
        """positions int64 ``[T]``, x ``[T, H]``; ``shared`` maps a layer type to the producer's
        ``(k, v)`` of this step (filled by a "store" layer, read by a "reuse" layer)."""
        t, d = positions.shape[0], self.head_dim
        out = self.qkv_proj(x)
        q = self.q_norm(out[:, : self.num_heads * d].reshape(t, self.num_heads, d))
        if self.reuse:
            q, _ = self.rotary[0](positions, q, q[:, :1])
            k, v = shared[self.layer_type]
        else:
            k = out[:, self.num_heads * d: (self.num_heads + self.num_kv_heads) * d].reshape(t, self.num_kv_heads, d)
            v = k if self.k_eq_v else out[:, (self.num_heads + self.num_kv_heads) * d:].reshape(t, self.num_kv_heads, d)
            v = _rms(v, self.eps)
            q, k = self.rotary[0](positions, q, self.k_norm(k))
            k, v = self._to_cache_shape(k), self._to_cache_shape(v)
            shared[self.layer_type] = (k, v)
        if self.cache_head_dim != d:
            q = F.pad(q, (0, self.cache_head_dim - d))
        o = self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))
        if self.cache_head_dim != d:
            o = o.reshape(t, self.num_heads, self.cache_head_dim)[..., :d].reshape(t, -1)
        return self.o_proj(o)


class Gemma4DecoderLayer(nn.Module):
    """``x += post_attn(attn(in(x))); x += post_ffw(mlp(pre_ffw(x))); [x += PLE]; x *= layer_scalar``."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, cache_idx: int,
                 cache_shape: tuple[int, int], reuse: bool) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx, rotary, cache_idx, cache_shape, reuse)
        wide = 2 if (getattr(config, "use_double_wide_mlp", False) and reuse) else 1
        self.mlp = GatedMLP(H, config.intermediate_size * wide, config.hidden_activation)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            self.act = ACTIVATIONS[config.hidden_activation]
            self.per_layer_input_gate = Linear(H, self.ple, bias=False)
            self.per_layer_projection = Linear(self.ple, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, per_layer_input: Optional[torch.Tensor],
                shared: dict) -> torch.Tensor:
        """x ``[T, H]``, per_layer_input ``[T, P]`` (PLE) or None -> ``[T, H]``."""
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), shared))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.ple:
            g = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar.to(x.dtype)


class Gemma4TextModel(nn.Module):
    """Scaled embedding (+ PLE) -> decoder layers (KV shared per ``kv_sharing_modes``) -> final norm."""

    def __init__(self, config) -> None:
        super().__init__()
        check_gemma4_config(config)
        n, H = int(config.num_hidden_layers), int(config.hidden_size)
        shapes = [_layer_shape(config, i) for i in range(n)]
        self.cache_shape = (max(s[0] for s in shapes), max(s[1] for s in shapes))
        modes = kv_sharing_modes(config)
        self.num_cache_layers = sum(m != "reuse" for m in modes)
        types = list(config.layer_types)
        head_dim_of = {t: shapes[types.index(t)][1] for t in set(types)}
        self.rotary = {t: gemma4_rotary(config, t, head_dim_of[t]) for t in sorted(set(types))}
        self.embed_tokens = Embedding(config.vocab_size, H)
        self.register_buffer("embed_scale", torch.tensor(H**0.5), persistent=False)
        last_of: dict[str, int] = {}
        layers = []
        for i in range(n):
            reuse = modes[i] == "reuse"
            if reuse and types[i] not in last_of:
                raise ValueError(f"num_kv_shared_layers: layer {i} ({types[i]}) reuses keys/values but no "
                                 "earlier layer of that type produces them")
            if not reuse:
                last_of[types[i]] = i
            layers.append(Gemma4DecoderLayer(config, i, self.rotary[types[i]], last_of[types[i]] if reuse else i,
                                             self.cache_shape, reuse))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            P = self.ple
            self.embed_tokens_per_layer = Embedding(int(config.vocab_size_per_layer_input), n * P)
            self.register_buffer("ple_embed_scale", torch.tensor(P**0.5), persistent=False)
            self.per_layer_model_projection = Linear(H, n * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE ``[T, L, P]`` from the token ids ``[T]`` and their scaled embeddings ``x [T, H]``."""
        from pagedllm.attention.backend import current_forward_context

        ctx = current_forward_context()
        if ctx is not None and ctx.inputs_embeds is not None:
            raise ValueError("prompt_embeds: not supported for Gemma 4 with per-layer embeddings "
                             "(hidden_size_per_layer_input)")
        n, P, t = len(self.layers), self.ple, x.shape[0]
        w = self.embed_tokens_per_layer.weight
        tok = (self.embed_tokens_per_layer(input_ids) * self.ple_embed_scale.to(w.dtype)).reshape(t, n, P)
        proj = (self.per_layer_model_projection(x) * x.shape[-1] ** -0.5).reshape(t, n, P)
        return (self.per_layer_projection_norm(proj) + tok.to(x.dtype)) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        ple = self.per_layer_inputs(input_ids, x) if self.ple else None
        shared: dict = {}
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, ple[:, i] if ple is not None else None, shared)
        return self.norm(x)


class Gemma4ForCausalLM(CausalLM):
    """HF ``Gemma4ForCausalLM`` (see the module docstring); logits soft-capped by
    ``final_logit_softcapping``."""

    def build(self, config) -> nn.Module:
        return Gemma4TextModel(config)

    def get_kv_cache_spec(self) -> tuple[int, int, int]:
        """``(non-shared layers, Hkv, D)``: the largest layer's KV shape (smaller ones pad)."""
        kv, d = self.model.cache_shape
        return self.model.num_cache_layers, kv, d


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text decoder of a multimodal Gemma 4 checkpoint, built from its ``text_config``; the
    vision / audio towers and their embedders are not loaded (text-only prompts). Checkpoint names
    ``model.language_model.*``."""

    ignored_weight_prefixes = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                               "model.embed_audio.", "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")

    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text is not config:
            # NOTE: transformers ties the head by the top-level config's flag, not the text config's
            text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        super().__init__(text, dtype)
