"""Image inputs: decoding and fetching (``media``), the HF processor wrapper (``processing``), the
per-request feature record (here) and the model runner's encoder cache (``encoder_cache``).

A prompt with images becomes token ids in which each image is a run of placeholder tokens
(the model's ``image_token_id``), plus one ``MultiModalFeature`` per image (vLLM v1's
``MultiModalFeatureSpec``): where its run starts and how long it is, its content hash (the
encoder-cache key and a prefix-cache extra key) and the processed pixels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class MultiModalFeature:
    """One image of a prompt.

    Attributes:
        modality: "image".
        identifier: hex sha256 of the decoded pixels (mode, size, bytes) and the processor kwargs:
            equal identifiers mean equal encoder outputs.
        offset: prompt position of the first placeholder token.
        length: placeholder tokens (= rows of the encoder output).
        data: the processor's ``pixel_values`` for this image, float ``[1, 3, H, W]`` (CPU).
        bidirectional: the model's image tokens attend to each other both ways (Gemma 3): a
            prefill chunk never ends inside the run.
        grid_thw: dynamic-resolution models (Qwen2.5-VL): the image's ``(t, h, w)`` patch grid
            (the processor's ``image_grid_thw`` row); ``data`` is then its patches ``[t*h*w, dim]``.
            None for fixed-size images.
        image_size: anyres-tiled models (LLaVA-NeXT): the image's original ``(height, width)``
            (the processor's ``image_sizes`` row); ``data`` is then its tiles ``[n, 3, S, S]``.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: Any
    bidirectional: bool = False
    grid_thw: Optional[tuple[int, int, int]] = None
    image_size: Optional[tuple[int, int]] = None
