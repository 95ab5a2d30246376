"""LLaVA-NeXT (LLaVA 1.6, HF ``LlavaNextForConditionalGeneration``): LLaVA's CLIP tower and MLP
projector (``models/llava.py``) over "anyres" tiles, packed with an ``image_newline`` embedding.

The image processor (``LlavaNextImageProcessor``) picks the best of ``image_grid_pinpoints`` for
the image's size, cuts the resized-and-padded image into ``rows x cols`` tiles of the tower's
``image_size`` and prepends the whole image resized to one tile (``pixel_values`` ``[N, tiles,
3, S, S]``, ``image_sizes`` ``[N, 2]`` as (height, width)). Each tile -> ``P = (S / patch)**2``
projected patch features; packing, as transformers' ``LlavaNextModel.pack_image_features`` with
``spatial_unpad``: the base tile's ``P`` rows, then the tiles' features laid out as one
``(rows * S/patch) x (cols * S/patch)`` grid, the padding rows (or columns) the processor added
cut off (``unpad_image``), and ``image_newline`` appended after each grid row. That is one
placeholder run per image (its length depends on the image's size and aspect ratio).

Checkpoint names: LLaVA's, plus ``image_newline`` / ``model.image_newline`` (``[hidden]``).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.llava import LlavaForConditionalGeneration


class ImageNewline(nn.Module):
    """Holds the ``[hidden]`` ``image_newline`` embedding as ``weight`` (so the vision-side
    loader copies it like the tower's tensors)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """HF ``LlavaNextForConditionalGeneration`` with a Llama/Mistral-shaped text model.

    ``embed_images(tiles [n, 3, S, S], image_size (height, width))`` -> ``[1, tokens, hidden]``.
    """

    vision_prefixes = LlavaForConditionalGeneration.vision_prefixes + (
        ("model.image_newline", "image_newline.weight"), ("image_newline", "image_newline.weight"))
    vision_modules = ("vision_tower", "multi_modal_projector", "image_newline")

    def build_vision(self, full) -> None:
        super().build_vision(full)
        self.image_newline = ImageNewline(full.get_text_config().hidden_size)
        self.grid_pinpoints = [list(p) for p in full.image_grid_pinpoints]
        self.tile_size = int(full.vision_config.image_size)
        self.tile_side = self.tile_size // int(full.vision_config.patch_size)

    def num_tiles(self, image_size) -> int:
        """Tiles (base included) the processor made for an image of ``image_size`` (height, width)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return image_size_to_num_patches(list(image_size), self.grid_pinpoints, self.tile_size)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor, image_size=None) -> torch.Tensor:  # type: ignore[override]
        """One image's tiles float ``[n, 3, S, S]`` (padding tiles past its count are ignored) and its
        original (height, width) -> packed embeddings ``[1, tokens, hidden]`` (model dtype).

        Raises:
            ValueError: no vision tower, or no ``image_size``.
        """
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        if image_size is None:
            raise ValueError("LLaVA-NeXT images need their image_size")
        tiles = pixel_values[: self.num_tiles(image_size)]
        feats = super().embed_images(tiles)  # [n, P, D]
        newline = self.image_newline.weight.to(feats.dtype)
        if feats.shape[0] == 1:
            return torch.cat([feats[0], newline[None]], 0).unsqueeze(0)
        base, rest = feats[0], feats[1:]
        side = self.tile_side
        rows, cols = get_anyres_image_grid_shape(list(image_size), self.grid_pinpoints, self.tile_size)
        grid = rest.reshape(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        grid = unpad_image(grid, list(image_size))  # [D, H', W']
        grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1)], -1)
        return torch.cat([base, grid.flatten(1, 2).T], 0).unsqueeze(0)

    def embed_feature(self, feature) -> torch.Tensor:
        """``[length, hidden]`` embeddings of one ``MultiModalFeature`` (its tiles and image size)."""
        return self.embed_images(feature.data, feature.image_size)[0]
