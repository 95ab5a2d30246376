"""Shared pieces of the image-text models built on a Llama-shaped decoder (LLaVA, Idefics3/SmolVLM):
the decoder whose image-placeholder rows take encoder outputs, the split of a multimodal config
into its text and full parts, and checkpoint loading of the vision-side modules.

The vision side (tower + projector/connector) runs as plain torch modules, one image (or one tile)
at a time, outside the paged KV cache; the model runner calls ``embed_images`` per
``MultiModalFeature`` and passes the embeddings to the decoder in ``ForwardContext.mm_embeds``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.models.llama import LlamaForCausalLM, LlamaModel


def copy_vision_tensors(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                        match: Callable[[str, dict], Optional[str]] = lambda n, t: n if n in t else None,
                        optional: Callable[[str], bool] = lambda k: False) -> set[str]:
    """Copy checkpoint ``tensors`` (our names) into the parameters and buffers ``targets`` (a
    vision tower's / projector's state-dict entries, prefixed by module name), casting each to the
    target's dtype; the vision side of a VLM's ``load_weights``.

    Args:
        match: the ``targets`` key a checkpoint name loads into, or None (default: the same name).
        optional: target keys a checkpoint may lack (e.g. ``position_ids`` buffers, an unused head).

    Returns:
        The target keys loaded.

    Raises:
        ValueError: a shape mismatch, a tensor no target takes, or a required target left unloaded.
    """
    targets = dict(targets)
    loaded: set[str] = set()
    unexpected = []
    for name, t in tensors.items():
        key = match(name, targets)
        if key is None:
            unexpected.append(name)
            continue
        dst = targets.pop(key)
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != parameter shape {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t.to(dst.dtype))
        loaded.add(key)
    if unexpected:
        raise ValueError(f"unexpected checkpoint tensors: {sorted(unexpected)}")
    missing = sorted(k for k in targets if not optional(k))
    if missing:
        raise ValueError(f"parameters missing from the checkpoint: {missing}")
    return loaded


def split_vision_weights(weights: Iterable[tuple[str, torch.Tensor]], vision_name: Callable[[str], Optional[str]],
                         vision: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the text decoder's ``(name, tensor)`` pairs of a checkpoint stream and put the
    vision-side ones into ``vision`` under ``vision_name(name)`` (our name; None = a text tensor),
    as the stream is consumed: the first step of a VLM's ``load_weights``."""
    for name, t in weights:
        v = vision_name(name)
        if v is None:
            yield name, t
        else:
            vision[v] = t


def run_vision_tower(model: nn.Module, tower: str, pixel_values: torch.Tensor, **kwargs: Any) -> Any:
    """``getattr(model, tower)(pixel_values=...)`` with ``pixel_values`` moved to the tower's
    device and dtype; ``kwargs`` go to the tower (the transformers module's own output object
    is returned).

    Raises:
        ValueError: the model was built without a vision tower (``model.supports_images`` False).
    """
    if not model.supports_images:
        raise ValueError("this model has no vision tower")
    module = getattr(model, tower)
    p = next(module.parameters())
    return module(pixel_values=pixel_values.to(p.device, p.dtype), **kwargs)


def split_mm_config(config) -> tuple[Any, Any]:
    """``(text config, full config or None)`` of a multimodal model.

    ``config`` is either the full transformers config (``vision_config`` present; tests build models
    from it) or the loader's text config (``hf_loader.text_model_config``) that carries the full one
    as a dict in ``mm_parent_config``; None when neither has a vision part (text only).
    """
    if hasattr(config, "vision_config"):
        full, text = config, config.get_text_config()
        if "tie_word_embeddings" not in text.__dict__:
            text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        return text, full
    full = getattr(config, "mm_parent_config", None)
    if isinstance(full, dict):
        from transformers import CONFIG_MAPPING

        full = CONFIG_MAPPING[full["model_type"]].from_dict(full)
    return config, full


def decode_with_mm_embeds(model: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``model``'s decoder layers and final norm over the token embeddings ``x`` ``[T, hidden]``,
    after its rows ``ForwardContext.mm_embeds[0]`` take the encoder outputs ``mm_embeds[1]``
    (``[R, hidden]``; no-op without a context or embeddings) -> hidden states ``[T, hidden]``."""
    from pagedllm.attention.backend import current_forward_context

    ctx = current_forward_context()
    if ctx is not None and ctx.mm_embeds is not None:
        rows, embeds = ctx.mm_embeds
        x = x.index_copy(0, rows.to(x.device), embeds.to(x.device, x.dtype))
    residual = None
    for layer in model.layers:
        x, residual = layer(positions, x, residual)
    return model.norm(x, residual)[0]


class MMLlamaModel(LlamaModel):
    """``LlamaModel`` whose rows ``ForwardContext.mm_embeds[0]`` take the embeddings
    ``mm_embeds[1]`` (``[R, hidden]``) in place of the placeholder tokens' embeddings."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return decode_with_mm_embeds(self, self.embed_tokens(input_ids), positions)


class LlamaVisionLanguageModel(LlamaForCausalLM):
    """Base of a Llama-decoder image-text model: subclasses set ``vision_prefixes`` and implement
    ``build_vision(full_config)`` (create the vision-side modules as attributes named in
    ``vision_modules``) and ``embed_images``.

    Attributes:
        supports_images: True when the config has a vision part (the engine then accepts images).
        image_token_id: the placeholder token whose rows take image embeddings.
        mm_bidirectional: False: image tokens attend causally (chunks may split an image run).
        vision_prefixes: ``(checkpoint prefix, our prefix)`` pairs, the first that matches wins.
        vision_modules: our attribute names of the vision-side modules.
    """

    mm_bidirectional = False
    vision_prefixes: tuple[tuple[str, str], ...] = ()
    vision_modules: tuple[str, ...] = ()
    # checkpoint prefixes of the text decoder (besides ``model.language_model.`` / ``language_model.``)
    text_prefixes: tuple[str, ...] = ()

    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        text, full = split_mm_config(config)
        super().__init__(text, dtype)
        self.mm_config = full
        self.supports_images = full is not None and getattr(full, "vision_config", None) is not None
        if self.supports_images:
            from pagedllm.models.base import default_dtype

            full.vision_config._attn_implementation = "sdpa"
            with default_dtype(dtype):
                self.build_vision(full)
            for m in self.vision_modules:
                for p in getattr(self, m).parameters():
                    p.optional = True  # loaded by load_weights' vision half, not the text loader
            self.image_token_id = int(getattr(full, "image_token_id", None) or full.image_token_index)

    def build(self, config) -> nn.Module:
        return MMLlamaModel(config, type(self))

    def build_vision(self, full) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _vision_name(self, name: str) -> Optional[str]:
        """Our (prefix-mapped) name of a vision-side checkpoint tensor, or None for a text tensor."""
        for ckpt, ours in self.vision_prefixes:
            if name.startswith(ckpt):
                return ours + name[len(ckpt):]
        return None

    def _canonical_name(self, name: str):
        v = self._vision_name(name) if self.supports_images else None
        if v is not None:  # the loader's preflight check: our exact parameter name
            if not hasattr(self, "_vision_keys"):
                self._vision_keys = {f"{m}.{k}" for m in self.vision_modules for k in getattr(self, m).state_dict()}
            return self._match(v, self._vision_keys) or v
        for p in self.text_prefixes:
            if name.startswith(p):
                name = "model." + name[len(p):]
                break
        return super()._canonical_name(name)

    def param_target(self, name: str) -> tuple[str, object]:
        if name.split(".", 1)[0] in self.vision_modules:
            return name, None  # NOTE: transformers' modules: no packed q/k/v
        return super().param_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Text decoder tensors through ``CausalLM.load_weights``; vision-side tensors copied into
        their modules (transformers' own parameter names; an inner ``vision_model.`` level is
        matched with or without it, as checkpoints differ there).

        Raises:
            ValueError: unexpected or missing vision-side tensors, or a shape mismatch.
        """
        if not self.supports_images:
            self.ignored_weight_prefixes = tuple(c for c, _ in self.vision_prefixes)
            return super().load_weights(weights)
        vision: dict[str, torch.Tensor] = {}
        loaded = super().load_weights(split_vision_weights(weights, self._vision_name, vision))
        targets = {f"{m}.{k}": v for m in self.vision_modules for k, v in getattr(self, m).state_dict().items()}
        return loaded | copy_vision_tensors(vision, targets, self._match, lambda k: k.endswith("position_ids"))

    @staticmethod
    def _match(name: str, targets: dict) -> Optional[str]:
        if name in targets:
            return name
        head, _, rest = name.partition(".")
        for alt in (f"{head}.vision_model.{rest}", f"{head}.{rest[len('vision_model.'):]}"
                    if rest.startswith("vision_model.") else None):
            if alt is not None and alt in targets:
                return alt
        return None
