"""EAGLE and EAGLE-3 draft heads for Llama-shaped targets (Li et al. 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty", arXiv:2401.15077; "EAGLE-3", arXiv:2503.01840).

Both read the target's hidden states and run one decoder layer with its own (paged) KV cache:

* EAGLE (``EagleHead``): ``h = fc([embed(token); hidden])`` (``2H -> H``), then one Llama decoder
  layer whose input norm is absent; no final norm; logits through the target's LM head. The
  hidden input is the target's last hidden state (after its final norm) at the previous position,
  then the head's own output for later draft steps.
* EAGLE-3 (``Eagle3Head``): the target's hidden states of three layers (low, middle, high)
  concatenated, ``fc: 3H -> H``; the decoder layer normalizes the embedding (``input_layernorm``)
  and the hidden (``hidden_norm``) separately and feeds their concatenation (``2H``) to q/k/v,
  with the un-normed hidden as the residual; a final ``norm``; its own LM head over a reduced
  draft vocabulary, mapped to target ids by ``d2t`` (``target = draft + d2t[draft]``). Later
  draft steps feed back the pre-norm output (``H`` wide: no ``fc``).

Checkpoint layouts (as published by the EAGLE authors and read by vLLM's ``llama_eagle`` /
``llama_eagle3``): EAGLE ``fc.weight``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``
(``embed_tokens.weight`` optional: the target's is shared); EAGLE-3 ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.*``, ``midlayer.mlp.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``
(``t2d`` is not needed).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.models.layers import (GatedMLP, Linear, QKVLinear, RMSNorm, RotaryEmbedding, SelfAttention,
                                    rope_inv_freq)
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_PACKED = LlamaForCausalLM.packed_modules_mapping


def _load(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename,
          packed: Optional[dict] = None) -> set[str]:
    """Copy checkpoint tensors into ``module``'s parameters/buffers; ``rename(name)`` maps a
    checkpoint name to ours (None = skip). Packed q/k/v and gate/up go through their loaders
    (``packed``: checkpoint module -> (fused module, shard id); default Llama's).

    Raises:
        ValueError: an unexpected tensor, a shape mismatch, or parameters left unloaded.
    """
    params = dict(module.named_parameters())
    bufs = dict(module.named_buffers())
    loaded: set[str] = set()
    unexpected = []
    for orig, t in weights:
        name = rename(orig)
        if name is None:
            continue
        shard = None
        for ckpt, (fused, sid) in (_PACKED if packed is None else packed).items():
            if f".{ckpt}." in name:
                name, shard = name.replace(f".{ckpt}.", f".{fused}."), sid
                break
        with torch.no_grad():
            if name in bufs:
                bufs[name].copy_(t.to(bufs[name].dtype))
                loaded.add(name)
                continue
            p = params.get(name)
            if p is None:
                unexpected.append(orig)
                continue
            if shard is not None:
                p.weight_loader(p, t.to(p.dtype), shard)
            else:
                if t.shape != p.shape:
                    raise ValueError(f"{orig}: checkpoint shape {tuple(t.shape)} != parameter shape {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))
            loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected draft-head tensors: {unexpected[:8]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"draft-head parameters missing from the checkpoint: {missing[:8]}")
    return loaded


class _NoNorm(nn.Module):
    """EAGLE-1's first layer has no input norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleHead(nn.Module):
    """EAGLE (v1) head over a Llama-shaped target (see the module docstring).

    Args:
        config: an HF Llama config of the head (hidden size = the target's; one layer).
        embed_tokens: the target's embedding (shared, not owned).
        dtype: parameter dtype.

    The decoder layer uses KV cache index 0 of the forward context (the head's own cache).
    """

    def __init__(self, config, embed_tokens: nn.Module, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        H = config.hidden_size
        self.embed = [embed_tokens]  # NOTE: shared, not a submodule
        head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            self.rotary = RotaryEmbedding(head_dim, *rope_inv_freq(config, head_dim))
            self.fc = Linear(2 * H, H, bias=bool(getattr(config, "eagle_fc_bias", False)))
            self.layer = LlamaDecoderLayer(config, 0, self.rotary, head_dim, LlamaForCausalLM)
        finally:
            torch.set_default_dtype(prev)
        self.layer.input_layernorm = _NoNorm()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids, positions int64 ``[T]``; hidden ``[T, H]`` (the target's hidden state at the
        previous position, or this head's previous output) -> ``[T, H]`` (fed to the target's LM
        head and back into the next draft step)."""
        x = self.fc(torch.cat([self.embed[0](input_ids).to(hidden.dtype), hidden], dim=-1))
        h, residual = self.layer(positions, x, None)
        return h + residual

    def get_kv_cache_spec(self) -> tuple[int, int, int]:
        """``(1, num_kv_heads, head_dim)``: the head's own one-layer KV cache."""
        a = self.layer.self_attn
        return 1, a.num_kv_heads, a.head_dim

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """EAGLE checkpoint names (``layers.0.*``, ``fc.*``; ``model.`` prefix optional;
        ``embed_tokens``/``lm_head`` are the target's and are skipped)."""
        def rename(n: str) -> Optional[str]:
            n = n.removeprefix("model.")
            if n.startswith(("embed_tokens.", "lm_head.", "norm.")) or n.endswith("rotary_emb.inv_freq"):
                return None
            if n.startswith("layers.0.input_layernorm."):
                return None  # NOTE: some exports carry it; EAGLE-1 does not apply it
            return "layer." + n[len("layers.0."):] if n.startswith("layers.0.") else n
        return _load(self, weights, rename)


class Eagle3Head(nn.Module):
    """EAGLE-3 head over a Llama-shaped target (see the module docstring).

    Args:
        config: HF config of the head: ``hidden_size`` (= the target's), heads, intermediate
            size, ``draft_vocab_size`` (default: ``vocab_size``), ``target_hidden_size``
            (default: ``hidden_size``).
        embed_tokens: the target's embedding (shared).
        dtype: parameter dtype.
    """

    def __init__(self, config, embed_tokens: nn.Module, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        H = config.hidden_size
        Ht = getattr(config, "target_hidden_size", None) or H
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.embed = [embed_tokens]
        head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
        eps = config.rms_norm_eps
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            self.rotary = RotaryEmbedding(head_dim, *rope_inv_freq(config, head_dim))
            self.fc = Linear(3 * Ht, H, bias=False)
            self.input_layernorm = RMSNorm(H, eps)
            self.hidden_norm = RMSNorm(H, eps)
            self.self_attn = SelfAttention(H, config.num_attention_heads, config.num_key_value_heads, head_dim, 0,
                                           self.rotary, head_dim**-0.5)
            # NOTE: q/k/v read [norm(embed); norm(hidden)]: 2H wide.
            self.self_attn.qkv_proj = QKVLinear(2 * H, config.num_attention_heads, config.num_key_value_heads,
                                                head_dim, False)
            self.post_attention_layernorm = RMSNorm(H, eps)
            self.mlp = GatedMLP(H, config.intermediate_size, config.hidden_act)
            self.norm = RMSNorm(H, eps)
            self.lm_head = Linear(H, self.draft_vocab_size, bias=False)
        finally:
            torch.set_default_dtype(prev)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[T, 3 Ht]`` (the target's three layers) or ``[T, H]`` (the previous draft
        step's pre-norm output) -> ``(normed [T, H] for the LM head, pre-norm [T, H] to feed back)``."""
        if hidden.shape[-1] != self.input_layernorm.weight.shape[0]:
            hidden = self.fc(hidden)
        emb = self.input_layernorm(self.embed[0](input_ids).to(hidden.dtype))
        residual = hidden
        h = self.self_attn(positions, torch.cat([emb, self.hidden_norm(hidden)], dim=-1))
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        normed, prenorm = self.norm(h, residual)
        return normed, prenorm

    def get_kv_cache_spec(self) -> tuple[int, int, int]:
        """``(1, num_kv_heads, head_dim)``: the head's own one-layer KV cache."""
        a = self.self_attn
        return 1, a.num_kv_heads, a.head_dim

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab_size]`` target-vocabulary logits: the draft vocabulary's logits at
        their target ids (``draft + d2t[draft]``), -inf elsewhere."""
        dl = self.lm_head(normed).float()
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            return dl
        out = torch.full((dl.shape[0], self.vocab_size), float("-inf"), dtype=dl.dtype, device=dl.device)
        out[:, torch.arange(self.draft_vocab_size, device=dl.device) + self.d2t] = dl
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """EAGLE-3 checkpoint names (``midlayer.*``, ``fc.*``, ``norm.*``, ``lm_head.*``, ``d2t``)."""
        def rename(n: str) -> Optional[str]:
            n = n.removeprefix("model.")
            if n.startswith("embed_tokens.") or n == "t2d" or n.endswith("rotary_emb.inv_freq"):
                return None
            return n[len("midlayer."):] if n.startswith("midlayer.") else n
        return _load(self, weights, rename)


def eagle3_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads: the residual stream entering layers 2, N/2 and N-3
    (vLLM's default: low, middle and high features)."""
    return (2, num_layers // 2, num_layers - 3)


__all__ = ["EagleHead", "Eagle3Head", "eagle3_aux_layer_ids"]
