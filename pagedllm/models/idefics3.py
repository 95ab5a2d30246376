"""Idefics3 / SmolVLM (HF ``Idefics3ForConditionalGeneration``): a SigLIP-like vision transformer
(transformers' ``Idefics3VisionTransformer``) over each image tile -> the pixel-shuffle connector
(``scale_factor**2`` neighbouring patches concatenated, then ``modality_projection.proj`` without
bias) -> ``image_seq_len`` embeddings per tile for a Llama decoder (causal attention).

The HF processor splits an image into ``rows x cols`` tiles plus a downscaled global image; each
tile is its own ``<image>`` placeholder run (between ``<row_r_col_c>`` / ``<global-img>`` markers),
so the engine sees one ``MultiModalFeature`` per tile (``multimodal.processing``).

Checkpoint names: ``model.vision_model.*``, ``model.connector.*``, ``model.text_model.*``, ``lm_head.*``.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.vlm import LlamaVisionLanguageModel, run_vision_tower


class Idefics3Connector(nn.Module):
    """``[N, S, Dv]`` tile features -> ``[N, S / r^2, D]`` (pixel shuffle by ``r = scale_factor``, then
    a linear map ``Dv * r^2 -> D``), as HF ``Idefics3Connector``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.scale_factor = int(config.scale_factor)
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(config.vision_config.hidden_size * self.scale_factor**2,
                                                  config.get_text_config().hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        r, side = self.scale_factor, int(s**0.5)
        x = x.reshape(n, side, side // r, d * r).permute(0, 2, 1, 3)
        x = x.reshape(n, side // r, side // r, d * r * r).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, s // (r * r), d * r * r))


class Idefics3ForConditionalGeneration(LlamaVisionLanguageModel):
    """HF ``Idefics3ForConditionalGeneration`` (SmolVLM).

    ``embed_images``: pixel_values float ``[N, 3, S, S]`` (N tiles of ``max_image_size``, the
    ``Idefics3ImageProcessor``'s output) -> ``[N, image_seq_len, D]``.
    """

    vision_prefixes = (("model.vision_model.", "vision_model."), ("model.connector.", "connector."),
                       ("vision_model.", "vision_model."), ("connector.", "connector."))
    vision_modules = ("vision_model", "connector")
    text_prefixes = ("model.text_model.", "text_model.")

    def build_vision(self, full) -> None:
        from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

        self.vision_model = Idefics3VisionTransformer(full.vision_config).eval()
        self.connector = Idefics3Connector(full)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values float ``[N, 3, S, S]`` (whole tiles: every patch attended) -> ``[N, S' , hidden]``.

        Raises:
            ValueError: the model was built without a vision tower.
        """
        h = run_vision_tower(self, "vision_model", pixel_values, return_dict=True).last_hidden_state
        return self.connector(h).to(self.dtype)
