"""LLaVA (HF ``LlavaForConditionalGeneration``): a CLIP (or SigLIP) vision tower -> the hidden states
of layer ``vision_feature_layer`` (CLS dropped under ``vision_feature_select_strategy`` "default")
-> a two-layer MLP projector (``linear_1``, ``projector_hidden_act``, ``linear_2``) -> one embedding
per ``<image>`` placeholder of a Llama-shaped decoder (causal attention throughout).

The tower is transformers' own module (``AutoModel.from_config(vision_config)``); the projector and
the decoder are ours. Checkpoint names: ``vision_tower.[vision_model.]*``,
``multi_modal_projector.*``, ``language_model.model.*`` / ``language_model.lm_head.*`` (the Hub's
llava-hf layout) or the same under ``model.`` (transformers 5 in-memory names).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.vlm import LlamaVisionLanguageModel, run_vision_tower


class LlavaMultiModalProjector(nn.Module):
    """``[N, P, Dv * layers]`` -> ``[N, P, D]``: ``linear_2(act(linear_1(x)))``."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        layers = 1 if isinstance(config.vision_feature_layer, int) else len(config.vision_feature_layer)
        d, bias = config.get_text_config().hidden_size, bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * layers, d, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaVisionLanguageModel):
    """HF ``LlavaForConditionalGeneration`` with a Llama/Mistral-shaped text model (LLaVA 1.5).

    ``embed_images``: pixel_values float ``[N, 3, H, W]`` (``CLIPImageProcessor``) -> ``[N, P, D]``,
    ``P`` = patches (``(H / patch) * (W / patch)``, + 1 under the "full" strategy).
    """

    vision_prefixes = (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                       ("model.multi_modal_projector.", "multi_modal_projector."),
                       ("multi_modal_projector.", "multi_modal_projector."))
    vision_modules = ("vision_tower", "multi_modal_projector")

    def build_vision(self, full) -> None:
        from transformers import AutoModel

        self.vision_tower = AutoModel.from_config(full.vision_config).eval()
        self.multi_modal_projector = LlavaMultiModalProjector(full)
        self.feature_layer = full.vision_feature_layer
        self.select_strategy = full.vision_feature_select_strategy

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values float ``[N, 3, H, W]`` -> image embeddings ``[N, P, hidden]`` (model dtype).

        Raises:
            ValueError: the model was built without a vision tower.
        """
        hs = run_vision_tower(self, "vision_tower", pixel_values, output_hidden_states=True,
                              return_dict=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        feats = [hs[i][:, 1:] if self.select_strategy == "default" else hs[i] for i in layers]
        return self.multi_modal_projector(torch.cat(feats, dim=-1)).to(self.dtype)
