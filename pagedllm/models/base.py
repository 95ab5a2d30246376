"""Common causal-LM plumbing: construction dtype, logits, KV-cache spec, checkpoint loading."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch
from torch import nn


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` (no float32 copy first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class CausalLM(nn.Module):
    """Base of every model: subclasses build ``self.model`` (with ``embed_tokens``, ``layers``,
    ``norm`` and ``forward(input_ids, positions)``) inside ``build()``.

    Checkpoint names are HF's; ``packed_modules_mapping`` maps a checkpoint module name onto
    ``(fused module name, shard id)`` (nano-vllm style).
    """

    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # NOTE: buffers some older checkpoints carry; recomputed here.
    ignored_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # Checkpoint tensors of parts this model does not build (e.g. a vision tower).
    ignored_weight_prefixes: tuple[str, ...] = ()

    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        with default_dtype(dtype):
            self.model = self.build(config)
            self.lm_head: Optional[nn.Linear] = None
            if not self.tie_word_embeddings:
                from pagedllm.models.layers import Linear
                self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        from pagedllm.models.layers import LogitsProcessor
        self.logits_processor = LogitsProcessor(getattr(config, "final_logit_softcapping", None) or None,
                                                self.logits_scaling(config))

    @classmethod
    def logits_scaling(cls, config) -> Optional[float]:
        """A divisor of the logits (None: none; Granite: ``config.logits_scaling``)."""
        return None

    def build(self, config) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions int64 ``[T]`` -> hidden states after the final norm ``[T, hidden]``."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden ``[N, hidden]`` -> float32 logits ``[N, vocab]`` (``LogitsProcessor``: the head's
        method, soft cap, scaling; None on a rank that does not emit logits)."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        return self.logits_processor(head, hidden)

    def get_kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the per-layer KV cache."""
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_hidden_layers, c.num_key_value_heads, head_dim

    def _canonical_name(self, name: str) -> Optional[str]:
        """Map a checkpoint name onto our naming (``model.`` prefix optional); None = ignore."""
        if name.endswith(self.ignored_weight_suffixes) or name.startswith(self.ignored_weight_prefixes):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("language_model."):  # older multimodal checkpoints: language_model.{model,lm_head}.*
            name = name[len("language_model."):]
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        return name

    def param_target(self, name: str) -> tuple[str, object]:
        """``(our parameter name, shard id)`` for a canonical checkpoint name (``_canonical_name``);
        shard None = the whole parameter. Packed q/k/v and gate/up shards, and MoE experts (per
        expert or stacked) onto ``FusedMoE``'s parameters."""
        if ".experts." in name:
            from pagedllm.models.moe import expert_param_target

            target = expert_param_target(name)
            if target is not None:
                return target
        for ckpt, (fused, sid) in self.packed_modules_mapping.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{fused}."), sid
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (casting to their dtype).

        Returns:
            the set of our parameter names that were loaded.

        Raises:
            ValueError: naming unexpected checkpoint tensors, shape mismatches, or parameters the
                checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        # NOTE: set by pipeline-parallel sharding: tensors of other stages' layers are skipped.
        keep = getattr(self, "weight_name_filter", None)  # canonical name -> bool
        loaded: set[str] = set()
        shards: dict[str, set] = {}
        unexpected: list[str] = []
        for orig, tensor in weights:
            name = self._canonical_name(orig)
            if name is None:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # NOTE: tied: the head is the embedding (HF state dicts list both)
            if keep is not None and not keep(name):
                continue
            name, shard = self.param_target(name)
            param = params.get(name)
            if param is None:
                unexpected.append(orig)
                continue
            with torch.no_grad():
                if shard is not None:
                    param.weight_loader(param, _cast(tensor, param), shard)
                    shards.setdefault(name, set()).add(shard)
                    if set(param.shard_ids) <= shards[name]:
                        loaded.add(name)
                elif hasattr(param, "whole_loader"):  # stacked MoE experts
                    param.whole_loader(param, _dense(tensor).to(param.dtype))
                    loaded.add(name)
                elif getattr(param, "weight_loader", None) is not None:
                    # NOTE: a quantization method's parameter (its loader checks and converts), or a
                    # tensor-parallel slice
                    param.weight_loader(param, _cast(tensor, param))
                    loaded.add(name)
                else:
                    tensor = _dense(tensor)
                    if tensor.shape != param.shape:
                        raise ValueError(f"{orig}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"parameter shape {tuple(param.shape)}")
                    param.copy_(tensor.to(param.dtype))
                    loaded.add(name)
        if unexpected:
            raise ValueError(f"unexpected checkpoint tensors: {sorted(unexpected)}")
        missing = sorted(n for n in set(params) - loaded if not getattr(params[n], "optional", False))
        if missing:
            raise ValueError(f"parameters missing from the checkpoint: {missing}")
        return loaded


def _dense(tensor) -> torch.Tensor:
    """A plain tensor for a parameter no quantization method owns (an MoE router, a norm):
    a quantization method's raw blocks (anything with ``dequantize()``, e.g. a GGUF Q8_0 router
    weight) are dequantized to float32; a tensor is returned as is."""
    if not isinstance(tensor, torch.Tensor) and hasattr(tensor, "dequantize"):
        return tensor.dequantize()
    return tensor


def _cast(tensor, param: torch.Tensor):
    """A floating checkpoint tensor in ``param``'s dtype; anything else (integer codes, a
    quantization method's raw blocks) unchanged."""
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and param.is_floating_point():
        return tensor.to(param.dtype)
    return tensor
