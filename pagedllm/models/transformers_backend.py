"""The transformers fallback (``--model-impl transformers``, or ``auto`` for an architecture pagedllm has no
native implementation of): any decoder-only model transformers can build, run with pagedllm's paged KV
cache, scheduler and sampler.

transformers' attention layers call the function registered under ``config._attn_implementation``
(``AttentionInterface``, transformers >= 4.48) with the step's q/k/v after rope. We register
``"pagedllm"``: it writes k/v into this layer's paged cache and attends through the active attention
backend (``get_forward_context()``), exactly as native models do, honouring the layer's scale, sliding
window and logit soft-cap. transformers builds no attention mask for an implementation without a
registered mask function, so the step's flat token run (``[1, T]``, one row holding every request) costs no
``T x T`` mask; requests are kept apart by the paged attention metadata, and positions come from the engine.

The model is transformers' own module tree: weights load through ``from_pretrained(state_dict=...)``
(its checkpoint-name conversions, e.g. per-expert MoE tensors, apply), and ``compute_logits`` runs the
``*ForCausalLM`` head code on the given hidden states, so model-specific logit scaling or soft-capping
is kept. Slower than a native model (transformers' modules, no fused kernels), but correct.

Refused with a ValueError naming the reason: architectures transformers cannot build as a causal LM,
configs needing custom code, layers whose K/V shapes differ (one cache shape per layer is assumed),
layers sharing another layer's KV cache, attention sinks.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.attention.backend import get_forward_context

ATTN_IMPLEMENTATION = "pagedllm"
_UNSUPPORTED_KWARGS = ("s_aux", "sinks")


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                            dropout: float = 0.0, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature over pagedllm's paged cache.

    Args:
        module: the calling attention module (its ``layer_idx`` selects the KV cache).
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` (rope applied).
        attention_mask: ignored (None: no mask function is registered; requests are separated by the
            paged metadata).
        scaling: softmax scale (None = D**-0.5); sliding_window: keys within the window; softcap: logit cap.

    Returns:
        ``(attn_output [1, T, Hq, D], None)``.

    Raises:
        NotImplementedError: attention sinks or other extra inputs this backend cannot apply.
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"transformers fallback: attention input {name!r} is not supported")
    ctx = get_forward_context()
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    cache = ctx.kv_caches[module.layer_idx] if ctx.kv_caches else None
    out = ctx.impl.forward(q, k, v, cache, ctx.attn_metadata, scale, sliding_window or None, softcap or None)
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def transformers_causal_lm_class(config) -> Optional[type]:
    """The transformers ``*ForCausalLM`` class for ``config`` (via ``AutoModelForCausalLM``'s mapping), or None."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):
        return None


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_kv_shapes(config) -> list[tuple[int, int]]:
    """``(num_kv_heads, head_dim)`` of every layer (per-layer configs of a heterogeneous config)."""
    text = _text_config(config)
    layers = text.per_layer_config if getattr(text, "is_heterogeneous", False) else [text] * text.num_hidden_layers
    out = []
    for c in layers:
        heads = c.num_attention_heads
        out.append((getattr(c, "num_key_value_heads", None) or heads,
                    getattr(c, "head_dim", None) or c.hidden_size // heads))
    return out


class _DecoderOutput:
    """What a decoder returns, for the head code: ``last_hidden_state`` (also ``[0]``); any other field
    (``past_key_values``, ``router_logits``, ...) is None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str):
        return None

    def __getitem__(self, i: int):
        return self.last_hidden_state if i == 0 else None


class _HiddenStates(nn.Module):
    """Stands in for the decoder inside ``*ForCausalLM.forward`` so that its head code runs on given
    hidden states: returns them as ``last_hidden_state``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: Optional[torch.Tensor] = None

    def forward(self, *args, **kwargs) -> _DecoderOutput:
        return _DecoderOutput(self.hidden)


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM behind pagedllm's model interface (see the module doc).

    Args:
        config: the transformers config (its ``architectures`` need not be native to pagedllm).
        dtype: parameter and activation dtype.

    Raises:
        ValueError: transformers has no causal-LM class for the config, or the model's layers do not fit
            one KV cache shape (see the module doc).
    """

    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        cls = transformers_causal_lm_class(config)
        if cls is None:
            raise ValueError(f"transformers fallback: transformers has no causal-LM model for model_type "
                             f"{getattr(config, 'model_type', None)!r} (architectures {config.architectures})")
        shapes = set(_layer_kv_shapes(config))
        if len(shapes) > 1:
            raise ValueError(f"transformers fallback: {cls.__name__}'s layers have different (KV heads, head_dim) "
                             f"{sorted(shapes)}: per-layer KV shapes are not supported (one cache shape per layer)")
        self._kv_shape = shapes.pop()
        if getattr(config, "num_kv_shared_layers", 0):
            raise ValueError(f"transformers fallback: {cls.__name__} shares KV caches across layers "
                             "(num_kv_shared_layers), which the paged cache does not model")
        _register()
        self.config, self.dtype, self._cls = config, dtype, cls
        self.hf = self._build(materialize=False)

    def _build(self, materialize: bool) -> nn.Module:
        from pagedllm.models.base import default_dtype

        self.config._attn_implementation = ATTN_IMPLEMENTATION
        device = torch.device("cpu") if materialize else torch.device("meta")
        with default_dtype(self.dtype), device:
            hf = self._cls._from_config(self.config, dtype=self.dtype)
        return hf.eval()

    def materialize(self) -> None:
        """Real (randomly initialised) parameters instead of meta tensors (``load_format="dummy"``)."""
        self.hf = self._build(materialize=True)
        self._check_layers()

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    def get_kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` from the (text) config."""
        return (_text_config(self.config).num_hidden_layers, *self._kv_shape)

    def _check_layers(self) -> None:
        """Every attention module's k projection must produce ``Hkv * D`` features (one cache shape)."""
        _, hkv, d = self.get_kv_cache_spec()
        for name, m in self.hf.named_modules():
            k = getattr(m, "k_proj", None)
            if hasattr(m, "layer_idx") and isinstance(k, nn.Linear) and k.out_features != hkv * d:
                raise ValueError(f"transformers fallback: {name} projects K to {k.out_features} features, not "
                                 f"num_key_value_heads x head_dim = {hkv * d}: per-layer KV shapes are not supported")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (HF names, any of transformers' checkpoint formats) through
        ``from_pretrained(state_dict=...)``.

        Raises:
            ValueError: naming parameters missing from the checkpoint, or unexpected tensors.
        """
        sd = {name: t for name, t in weights}
        self.config._attn_implementation = ATTN_IMPLEMENTATION
        hf, info = self._cls.from_pretrained(None, config=self.config, state_dict=sd, dtype=self.dtype,
                                             attn_implementation=ATTN_IMPLEMENTATION, output_loading_info=True)
        missing = sorted(info.get("missing_keys") or [])
        unexpected = sorted(info.get("unexpected_keys") or [])
        mismatched = info.get("mismatched_keys") or []
        if missing or unexpected or mismatched:
            raise ValueError(f"transformers fallback ({self._cls.__name__}): checkpoint does not fit: "
                             f"missing {missing[:20]}, unexpected {unexpected[:20]}, mismatched {list(mismatched)[:5]}")
        self.hf = hf.eval()
        self._check_layers()
        return {n for n, _ in self.hf.named_parameters()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions int64 ``[T]`` -> the decoder's last hidden states ``[T, hidden]``."""
        from pagedllm.attention.backend import current_forward_context
        ctx = current_forward_context()
        if ctx is not None and ctx.inputs_embeds is not None:  # prompt embeddings in place of lookups
            rows, embeds = ctx.inputs_embeds
            x = self.decoder.get_input_embeddings()(input_ids)
            x = x.index_copy(0, rows.to(x.device), embeds.to(x.device, x.dtype))
            out = self.decoder(inputs_embeds=x.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
            return out.last_hidden_state[0]
        out = self.decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> float32 logits ``[N, vocab]`` through the ``*ForCausalLM`` head code."""
        prefix = self.hf.base_model_prefix
        decoder, stand_in = getattr(self.hf, prefix), _HiddenStates()
        stand_in.hidden = hidden.unsqueeze(0)
        try:
            setattr(self.hf, prefix, stand_in)
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            logits = self.hf(input_ids=ids, use_cache=False).logits
        finally:
            setattr(self.hf, prefix, decoder)
        return logits[0].float()
