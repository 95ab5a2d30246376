"""The model's HF processor (``transformers.AutoProcessor``): prompt text + images -> token ids with
each image's placeholder expanded (Gemma 3: ``<start_of_image>`` -> ``\\n\\n<boi>`` + N image tokens
+ ``<eoi>\\n\\n``), the pixel values, and one ``MultiModalFeature`` per image."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.engine.input_processor import InputValidationError
from pagedllm.multimodal import MultiModalFeature
from pagedllm.multimodal.media import check_image, image_hash


class ImageProcessor:
    """Runs the HF processor of an image-text model.

    Args:
        hf_processor: the ``AutoProcessor`` of the checkpoint.
        image_token_id: the placeholder id the model replaces with image embeddings.
        bidirectional: the model's image tokens attend both ways (``MultiModalFeature.bidirectional``).
        limit_per_prompt: most images one prompt may carry (vLLM's ``--limit-mm-per-prompt``).
        default_kwargs: processor kwargs applied to every request (``--mm-processor-kwargs``).
    """

    def __init__(self, hf_processor: Any, image_token_id: int, bidirectional: bool, limit_per_prompt: int = 1,
                 default_kwargs: Optional[dict] = None) -> None:
        self.hf = hf_processor
        self.image_token_id = int(image_token_id)
        self.bidirectional = bidirectional
        self.limit = limit_per_prompt
        self.default_kwargs = dict(default_kwargs or {})
        #: longest image run one prefill chunk can hold (bidirectional runs are never split); None = no cap
        self.max_run: Optional[int] = None
        # the text the prompt marks an image with (the processor expands it)
        self.placeholder = getattr(hf_processor, "image_token", None) or getattr(hf_processor, "boi_token", None)
        from pagedllm.multimodal.media import MediaConnector
        #: where image URLs may come from (set from the engine's media settings)
        self.media = MediaConnector()

    @classmethod
    def from_pretrained(cls, path: str, image_token_id: int, bidirectional: bool, limit_per_prompt: int = 1,
                        default_kwargs: Optional[dict] = None) -> "ImageProcessor":
        """Load ``AutoProcessor`` from the checkpoint directory ``path``.

        Raises:
            ValueError: the checkpoint has no processor files.
        """
        from transformers import AutoProcessor

        try:
            try:
                proc = AutoProcessor.from_pretrained(path)
            except ImportError:  # a video processor that needs torchvision (Qwen2.5-VL): images only
                proc = image_only_processor(path)
        except Exception as e:
            raise ValueError(f"cannot load the image processor of {path}: {e}") from e
        if not hasattr(proc, "image_processor"):
            raise ValueError(f"{path}: AutoProcessor gave {type(proc).__name__}, which has no image processor")
        return cls(proc, image_token_id, bidirectional, limit_per_prompt, default_kwargs)

    def process(self, text: str, images: list, add_special_tokens: bool, kwargs: Optional[dict] = None,
                field: str = "multi_modal_data") -> tuple[list[int], list[MultiModalFeature]]:
        """Tokenize ``text`` with ``images`` (RGB ``PIL.Image`` list, in prompt order).

        Returns:
            ``(token ids, features)``: one feature per image, in order, each naming its placeholder run.

        Raises:
            InputValidationError: more than ``limit_per_prompt`` images (param ``field``), a bad
                ``mm_processor_kwargs`` value, or a prompt whose image markers do not match the images
                (the processor's message).
        """
        if len(images) > self.limit:
            raise InputValidationError(f"{field}: at most {self.limit} image(s) may be provided in one prompt "
                                       f"(--limit-mm-per-prompt), got {len(images)}", field)
        images = [check_image(im, field) for im in images]
        kw = {**self.default_kwargs, **(kwargs or {})}
        if not isinstance(kw, dict):
            raise InputValidationError("mm_processor_kwargs: must be an object", "mm_processor_kwargs")
        try:
            out = self.hf(text=text, images=images or None, return_tensors="pt",
                          add_special_tokens=add_special_tokens, **kw)
        except (ValueError, TypeError, KeyError) as e:
            raise InputValidationError(f"{field}: {e}", field) from None
        ids = out["input_ids"][0].tolist()
        runs: list[tuple[int, int]] = []
        i, tok = 0, self.image_token_id
        while i < len(ids):
            if ids[i] == tok:
                j = i
                while j < len(ids) and ids[j] == tok:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        pixels = out.get("pixel_values") if images else None
        sizes = out.get("image_sizes") if images else None
        if sizes is not None and pixels is not None and pixels.dim() == 5 and len(runs) == len(images):
            # anyres tiles (LLaVA-NeXT): one run per image, its tiles [1, n, 3, S, S] and (height, width)
            return ids, [MultiModalFeature("image", image_hash(img, kw), off, n, pixels[k].contiguous(),
                                           self.bidirectional, image_size=tuple(int(x) for x in sizes[k].tolist()))
                         for k, (img, (off, n)) in enumerate(zip(images, runs))]
        tiled = pixels is not None and pixels.dim() == 5  # [1, tiles, 3, H, W] (Idefics3): one run per tile
        if tiled and len(runs) == pixels.shape[1] and len(runs) >= len(images):
            return ids, [MultiModalFeature("image", _tile_hash(pixels[0, k], kw), off, n,
                                           pixels[0, k:k + 1].contiguous(), self.bidirectional)
                         for k, (off, n) in enumerate(runs)]
        if len(runs) != len(images):
            raise InputValidationError(
                f"{field}: the prompt has {len(runs)} image placeholder run(s) for {len(images)} image(s); mark each "
                f"image with {self.placeholder!r} in the prompt (or use chat image parts)", field)
        if self.bidirectional and self.max_run is not None and any(n > self.max_run for _, n in runs):
            raise InputValidationError(
                f"{field}: an image takes {max(n for _, n in runs)} tokens, more than one prefill chunk holds "
                f"({self.max_run}, max_num_batched_tokens); this model's image tokens cannot be split", field)
        grids = out.get("image_grid_thw") if images else None
        if grids is not None:  # dynamic resolution (Qwen2.5-VL): pixel_values are all images' patches
            return ids, _grid_features(images, runs, pixels, grids, kw, self.bidirectional)
        feats = []
        for k, (img, (off, n)) in enumerate(zip(images, runs)):
            feats.append(MultiModalFeature("image", image_hash(img, kw), off, n, pixels[k:k + 1].contiguous(),
                                           self.bidirectional))
        return ids, feats


def image_only_processor(path: str) -> Any:
    """The checkpoint's processor (``processor_class`` of ``processor_config.json`` or
    ``preprocessor_config.json``) built from its image processor and tokenizer alone, without the
    video processor that transformers' ``AutoProcessor`` insists on loading (Qwen2-VL's and
    Qwen2.5-VL's need torchvision, which serving images does not).

    Raises:
        ValueError: no ``processor_class`` in the checkpoint, or one transformers does not have.
        OSError: the image processor's or the tokenizer's files are missing.
    """
    import json
    import os

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name = None
    for fn in ("processor_config.json", "preprocessor_config.json"):
        f = os.path.join(path, fn)
        if name is None and os.path.isfile(f):
            with open(f) as fh:
                name = json.load(fh).get("processor_class")
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"{path}: no known processor_class ({name!r})")
    return make_image_only_processor(cls, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path))


def make_image_only_processor(cls: type, image_processor: Any, tokenizer: Any, chat_template: Optional[str] = None) -> Any:
    """An instance of the transformers processor class ``cls`` whose video processor is None (the
    class's other sub-processors too): it processes text and images as ``cls`` does."""

    class ImageOnly(cls):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name != "tokenizer":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    kw = {a: None for a in cls.get_attributes()}
    kw.update(image_processor=image_processor, tokenizer=tokenizer)
    return ImageOnly(**kw, chat_template=chat_template or getattr(tokenizer, "chat_template", None))


def _grid_features(images: list, runs: list[tuple[int, int]], pixels: Any, grids: Any, kwargs: dict,
                   bidirectional: bool) -> list[MultiModalFeature]:
    """One feature per image of a dynamic-resolution processor: ``pixels`` float ``[sum t*h*w, dim]``
    (every image's patches, in order) split by ``grids`` int ``[N, 3]`` (``image_grid_thw``)."""
    feats, start = [], 0
    for img, (off, n), g in zip(images, runs, grids.tolist()):
        t, h, w = (int(x) for x in g)
        feats.append(MultiModalFeature("image", image_hash(img, kwargs), off, n,
                                       pixels[start:start + t * h * w].contiguous(), bidirectional, (t, h, w)))
        start += t * h * w
    return feats


def _tile_hash(tile: Any, kwargs: dict) -> str:
    """Hex sha256 of one processed tile (float pixels ``[3, H, W]``) and the processor kwargs: a
    model that splits images into tiles keys its encoder cache and prefix cache by tile content."""
    import hashlib

    h = hashlib.sha256(f"tile:{tuple(tile.shape)}:{tile.dtype}:".encode())
    h.update(tile.contiguous().numpy().tobytes())
    if kwargs:
        h.update(repr(sorted(kwargs.items())).encode())
    return h.hexdigest()


def build_image_processor(args: Any, core: Any) -> Optional[ImageProcessor]:
    """The engine's ``ImageProcessor`` when the loaded model takes images, else None.

    A model takes images when its class has a vision tower (``embed_images``, e.g. Gemma 3's
    ``Gemma3ForConditionalGeneration`` from safetensors with a ``vision_config``), the worker runs in
    process (the pixels ride on the scheduler output by reference) and the checkpoint has processor
    files.

    Raises:
        ValueError: a bad ``limit_mm_per_prompt`` (unknown modality, not a count >= 0).
    """
    import logging

    from pagedllm.models.registry import MODEL_REGISTRY

    limits = args.limit_mm_per_prompt or {}
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f"limit_mm_per_prompt: only {{'image': N}} is supported, got {limits!r}")
    limit = limits.get("image", 1)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit_mm_per_prompt: 'image' must be an integer >= 0, got {limit!r}")
    cfg = core.hf_config
    parent = getattr(cfg, "mm_parent_config", None)
    if not isinstance(parent, dict) or parent.get("vision_config") is None or limit == 0:
        return None
    cls = next((MODEL_REGISTRY[a] for a in getattr(cfg, "architectures", None) or [] if a in MODEL_REGISTRY), None)
    log = logging.getLogger("pagedllm.multimodal")
    if cls is None or not hasattr(cls, "embed_images") or args.model_impl == "transformers":
        return None
    if type(core.executor).__name__ != "UniProcExecutor":
        log.warning("pagedllm: image inputs need the in-process worker (tensor/pipeline parallel size 1); "
                    "serving text only")
        return None
    path = getattr(core.loaded, "model_path", None)
    mmproj = getattr(core.loaded, "mmproj", None)  # GGUF + mmproj (pagedllm/loader/gguf_mmproj.py)
    if (getattr(core.loaded, "source", None) == "gguf" and mmproj is None) or not path:
        return None
    try:
        if mmproj is not None:
            proc = ImageProcessor(mmproj.hf_processor(core.loaded.tokenizer), parent["image_token_id"],
                                  bool(getattr(cls, "mm_bidirectional", False)), limit, args.mm_processor_kwargs)
        else:
            proc = ImageProcessor.from_pretrained(path, parent.get("image_token_id", parent.get("image_token_index")), bool(getattr(cls, "mm_bidirectional", False)),
                                                  limit, args.mm_processor_kwargs)
    except ValueError as e:
        log.warning("pagedllm: %s; serving text only", e)
        return None
    from pagedllm.multimodal.media import MediaConnector
    proc.media = MediaConnector(args.allowed_local_media_path or "", args.allowed_media_domains)
    t = getattr(args, "long_prefill_token_threshold", 0) or 0
    proc.max_run = min(args.max_num_batched_tokens, t) if t > 0 else args.max_num_batched_tokens
    return proc


def image_collector(input_processor: Any) -> Any:
    """An ``engine.chat.ImageCollector`` for the engine's image processor, or None (text-only)."""
    from pagedllm.engine.chat import ImageCollector

    ip = getattr(input_processor, "image_processor", None)
    return ImageCollector(ip.media) if ip is not None else None
