"""Gemma 3 image-text (HF ``Gemma3ForConditionalGeneration``): SigLIP vision tower -> multi-modal
projector -> image embeddings that replace the image placeholder tokens of the Gemma 3 text decoder
(``pagedllm.models.gemma3``), whose image tokens attend to each other bidirectionally.

The vision tower is transformers' own SigLIP module (plain torch, not paged: it sees one image at a
time, no KV cache). The projector, as HF's ``Gemma3MultiModalProjector``: ``[N, P*P, Dv]`` patch
features -> ``AvgPool2d`` over the ``P x P`` patch grid to ``mm_tokens_per_image`` tokens -> Gemma
RMSNorm (``1 + w``) -> ``@ mm_input_projection_weight [Dv, D]``.

Image embeddings enter after the ``sqrt(hidden)`` embedding scale (HF scatters them into the
already scaled ``inputs_embeds``). Attention among the tokens of one image's placeholder run is
bidirectional in every layer (HF 5.24 ``create_masks_for_vision_model``: full layers
``causal OR same-image``, sliding layers ``window AND (causal OR same-image)``); the model runner
passes the runs in ``AttentionMetadata.bidirectional_ranges`` and the scheduler never ends a
prefill chunk inside one (``mm_bidirectional``).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedllm.models.base import default_dtype
from pagedllm.models.gemma3 import Gemma3ForCausalLM, Gemma3TextModel
from pagedllm.models.layers import RMSNorm
from pagedllm.models.vlm import (copy_vision_tensors, decode_with_mm_embeds, run_vision_tower,
                                 split_vision_weights)

VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3MultiModalProjector(nn.Module):
    """``[N, P*P, Dv]`` vision features -> ``[N, mm_tokens_per_image, D]`` text-space embeddings."""

    def __init__(self, config) -> None:
        super().__init__()
        v, t = config.vision_config, config.get_text_config()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden_size, t.hidden_size))
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, gemma=True)
        self.patches_per_image = int(v.image_size // v.patch_size)
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        k = self.patches_per_image // tokens_per_side
        self.avg_pool = nn.AvgPool2d(kernel_size=k, stride=k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        p = self.patches_per_image
        h = self.avg_pool(x.transpose(1, 2).reshape(n, d, p, p).contiguous()).flatten(2).transpose(1, 2)
        h = self.mm_soft_emb_norm(h.contiguous())
        return torch.matmul(h, self.mm_input_projection_weight).type_as(x)


class Gemma3MMTextModel(Gemma3TextModel):
    """The Gemma 3 decoder; rows of ``ForwardContext.mm_embeds`` take the image embeddings after
    the embedding scale."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        vocab = self.embed_tokens.num_embeddings
        x = self.embed_tokens(input_ids.clamp(max=vocab - 1) if input_ids.numel() else input_ids)
        return decode_with_mm_embeds(self, x * self.embed_scale.to(x.dtype), positions)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """HF ``Gemma3ForConditionalGeneration``: the text decoder (built from ``text_config``) plus,
    when the config has a ``vision_config``, the SigLIP tower and projector.

    Checkpoint names: ``model.language_model.*`` / ``model.vision_tower.*`` /
    ``model.multi_modal_projector.*`` (transformers 5) or ``language_model.model.*`` /
    ``vision_tower.vision_model.*`` / ``multi_modal_projector.*`` (older).

    Attributes:
        supports_images: True when the vision tower was built (the engine accepts images).
        mm_bidirectional: image tokens attend bidirectionally (chunks never end inside a run).
        image_token_id: the placeholder id whose rows take image embeddings.
        mm_tokens_per_image: placeholder tokens (and embeddings) per image.
    """

    mm_bidirectional = True

    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        if hasattr(config, "vision_config"):  # the full config (a transformers-built model, tests)
            full, text = config, config.get_text_config()
            if "tie_word_embeddings" not in text.__dict__:
                text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        else:  # the loader's text config (hf_loader.text_model_config): the full one as a dict
            text, full = config, getattr(config, "mm_parent_config", None)
            if isinstance(full, dict):
                from transformers import CONFIG_MAPPING

                full = CONFIG_MAPPING[full["model_type"]].from_dict(full)
        super().__init__(text, dtype)
        self.supports_images = full is not None and getattr(full, "vision_config", None) is not None
        self.mm_config = full
        if self.supports_images:
            from transformers import AutoModel

            vcfg = full.vision_config
            vcfg._attn_implementation = "sdpa"
            with default_dtype(dtype):
                self.vision_tower = AutoModel.from_config(vcfg)
                self.multi_modal_projector = Gemma3MultiModalProjector(full)
            for p in list(self.vision_tower.parameters()) + list(self.multi_modal_projector.parameters()):
                p.optional = True  # loaded by load_weights below, not the text loader
            self.image_token_id = int(getattr(full, "image_token_id", None) or full.image_token_index)
            self.mm_tokens_per_image = int(full.mm_tokens_per_image)

    def build(self, config) -> nn.Module:
        return Gemma3MMTextModel(config, type(self))

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values float ``[N, 3, H, W]`` (the image processor's output) -> image embeddings
        ``[N, mm_tokens_per_image, hidden]`` in the model dtype.

        Raises:
            ValueError: the model was built without a vision tower.
        """
        out = run_vision_tower(self, "vision_tower", pixel_values).last_hidden_state
        return self.multi_modal_projector(out)

    def _vision_name(self, name: str):
        """Our name of a vision-tower / projector checkpoint tensor, or None for other tensors."""
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name[len("vision_tower.vision_model."):]
        return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None

    def _canonical_name(self, name: str):
        v = self._vision_name(name) if self.supports_images else None
        return v if v is not None else super()._canonical_name(name)

    def param_target(self, name: str) -> tuple[str, object]:
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None  # NOTE: HF modules: no packed q/k/v
        return super().param_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text decoder's tensors through ``CausalLM.load_weights``; the vision tower's and the
        projector's copied into their modules (names as in ``transformers``' own state dicts).

        Raises:
            ValueError: unexpected or missing vision/projector tensors, or shape mismatches.
        """
        if not self.supports_images:
            self.ignored_weight_prefixes = VISION_PREFIXES + PROJECTOR_PREFIXES
            return super().load_weights(weights)
        vision: dict[str, torch.Tensor] = {}
        loaded = super().load_weights(split_vision_weights(weights, self._vision_name, vision))
        targets = {f"vision_tower.{k}": v for k, v in self.vision_tower.state_dict().items()}
        targets.update({f"multi_modal_projector.{k}": v for k, v in self.multi_modal_projector.state_dict().items()})
        return loaded | copy_vision_tensors(vision, targets, optional=lambda k: k.startswith("vision_tower.head."))
