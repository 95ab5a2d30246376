"""llama.cpp's multimodal split: a GGUF text model plus an ``mmproj`` GGUF holding the vision tower and
the projector (what ``llama-server --mmproj`` and Ollama load, e.g. for Gemma 3 GGUFs).

    lm = load_model("gemma-3-4b-it-Q4_K_M.gguf", mmproj="mmproj-model-f16.gguf")
    lm.hf_config.architectures -> ["Gemma3ForConditionalGeneration"]   # text blocks stay quantized

The mmproj file (llama.cpp ``convert_hf_to_gguf.py --mmproj``; gguf-py ``Keys.Clip`` / ``Keys.ClipVision``
and ``MODEL_TENSOR.V_*`` names):

* ``general.architecture = "clip"`` (gguf-py ``MODEL_ARCH.MMPROJ``), ``general.type = "mmproj"``,
  ``clip.has_vision_encoder = true``, ``clip.projector_type`` (or ``clip.vision.projector_type`` in a
  mixed-modality file) naming the projector: ``"gemma3"`` here.
* vision hyper-parameters ``clip.vision.{image_size, patch_size, embedding_length, feed_forward_length,
  block_count, attention.head_count, attention.layer_norm_epsilon, image_mean, image_std,
  projection_dim}`` (``projection_dim`` = the text model's hidden size), and for Gemma 3
  ``clip.vision.projector.scale_factor`` (the average-pool kernel; written only when it is not 4).
* tensors ``v.patch_embd``, ``v.position_embd``, ``v.blk.N.{attn_q, attn_k, attn_v, attn_out, ln1, ln2,
  ffn_up, ffn_down}``, ``v.post_ln`` (SigLIP), and Gemma 3's projector ``mm.input_projection.weight``
  (HF's ``mm_input_projection_weight``, ``[Dv, D]`` as in HF, written F16) and ``mm.soft_emb_norm.weight``
  (stored as ``1 + w``, as llama.cpp stores Gemma RMSNorm weights; 1 is subtracted here).

The vision side runs as transformers' SigLIP module in float (the model dtype): its tensors (F32, F16,
BF16, Q8_0 or any type gguf-py dequantizes) are dequantized at load; the text model's blocks are kept
quantized as for a text-only GGUF. The image processor is built from the mmproj metadata
(``Gemma3ImageProcessor``: resize to ``image_size`` square, rescale 1/255, normalize with
``image_mean`` / ``image_std``) and the text model's tokenizer and chat template.

Auto-detection (``find_mmproj``): with no ``mmproj`` given, a file named ``mmproj*.gguf`` (case-insensitive)
in the text model's directory is used, as llama.cpp users lay out Hub downloads; with several, the one whose
name says ``f16`` (not ``bf16``), else the first by name. A detected file that does not fit the text model
is skipped with a warning (text only); an explicit one raises ``ValueError``. ``mmproj="none"`` turns the
detection off.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .gguf_file import GGUFFile

logger = logging.getLogger(__name__)

MMPROJ_ARCH = "clip"  # gguf-py MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ]
#: projector type -> the text GGUF architectures it feeds and the HF class built from the pair
PROJECTORS = {"gemma3": (("gemma3",), "Gemma3ForConditionalGeneration")}
# Gemma 3's image markers (its tokenizer's boi / eoi / image soft token)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}

_V = "model.vision_tower."  # transformers 5 names (older checkpoints add ".vision_model")
_SIGLIP_NAMES = {
    "v.patch_embd": _V + "embeddings.patch_embedding",
    "v.position_embd": _V + "embeddings.position_embedding",
    "v.post_ln": _V + "post_layernorm",
}
_SIGLIP_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                 "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GEMMA3_PROJ = {"mm.input_projection.weight": "model.multi_modal_projector.mm_input_projection_weight",
                "mm.soft_emb_norm.weight": "model.multi_modal_projector.mm_soft_emb_norm.weight"}
_VBLK = re.compile(r"^v\.blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_vision_name(name: str) -> str | None:
    """The HF ``Gemma3ForConditionalGeneration`` checkpoint name of mmproj tensor ``name``, or None.
    E.g. ``"v.blk.0.attn_q.weight"`` -> ``"model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"``."""
    if name in _GEMMA3_PROJ:
        return _GEMMA3_PROJ[name]
    m = _VBLK.match(name)
    if m:
        part = _SIGLIP_LAYER.get(m.group(2))
        return None if part is None else f"{_V}encoder.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    return f"{_SIGLIP_NAMES[base]}.{kind}" if base in _SIGLIP_NAMES and kind in ("weight", "bias") else None


@dataclass
class MMProj:
    """An opened mmproj GGUF: its projector type and the HF configs it implies.

    Attributes:
        path: the file.
        file: the opened ``GGUFFile`` (tensors read lazily from the mapping).
        projector_type: ``clip.projector_type``, e.g. "gemma3".
        vision_config: ``SiglipVisionConfig`` keyword arguments from ``clip.vision.*``.
        projection_dim: the text hidden size the projector outputs (``clip.vision.projection_dim``).
        image_mean, image_std: per-channel normalization (3 floats each).
        tokens_per_image: image embeddings (placeholder tokens) per image.
        token_ids: the text vocabulary's ids of the image markers, set by ``attach_mmproj``.
    """

    path: str
    file: GGUFFile
    projector_type: str
    vision_config: dict
    projection_dim: int
    image_mean: list
    image_std: list
    tokens_per_image: int
    token_ids: dict = field(default_factory=dict)

    def weights(self, dtype: Any) -> Iterator[tuple[str, Any]]:
        """``(HF name, tensor)`` for every vision / projector tensor, dequantized to ``dtype``, in HF layout
        (the soft-embedding norm's stored ``1 + w`` turned back into ``w``, in float32 before the cast).

        Raises:
            ValueError: a tensor with no HF counterpart (a file this loader does not understand).
        """
        import torch

        from .gguf_loader import dequantize_tensor

        for name in self.file.tensors:
            target = hf_vision_name(name)
            if target is None:
                raise ValueError(f"{self.path}: mmproj tensor {name!r} has no counterpart in the "
                                 f"{self.projector_type} vision model")
            if name == "mm.soft_emb_norm.weight":
                yield target, (dequantize_tensor(self.file, name, torch.float32) - 1.0).to(dtype)
            else:
                yield target, dequantize_tensor(self.file, name, dtype)
        self.file.drop_pages()

    def hf_processor(self, tokenizer: Any) -> Any:
        """A ``transformers.Gemma3Processor`` for this projector: ``Gemma3ImageProcessor`` from the mmproj
        metadata, ``tokenizer`` (the text model's; its chat template) with Gemma 3's image markers set as
        its ``boi_token`` / ``eoi_token`` / ``image_token`` when it lacks them (a GGUF vocabulary carries the
        tokens, not transformers' named special-token attributes)."""
        import transformers as tf

        missing = {attr: tok for attr, tok in GEMMA3_TOKENS.items() if getattr(tokenizer, attr, None) is None}
        if missing:  # NOTE: transformers 5's hook for a multimodal tokenizer's named tokens (and their *_id)
            tokenizer._set_model_specific_special_tokens(special_tokens=missing)
        size = int(self.vision_config["image_size"])
        ip = tf.Gemma3ImageProcessor(size={"height": size, "width": size}, image_mean=list(self.image_mean),
                                     image_std=list(self.image_std))
        return tf.Gemma3Processor(image_processor=ip, tokenizer=tokenizer, image_seq_length=self.tokens_per_image,
                                  chat_template=getattr(tokenizer, "chat_template", None))


def _floats(v: Any, default: list) -> list:
    return [float(x) for x in (default if v is None else list(v))]


def open_mmproj(path: str) -> MMProj:
    """Open and check an mmproj GGUF (module docstring for the keys read).

    Raises:
        ValueError: not a file / not GGUF; not an mmproj (``general.architecture`` other than "clip": e.g. a
            text model passed as ``--mmproj``); no vision encoder (an audio-only projector); a projector type
            other than those in ``PROJECTORS``; missing vision hyper-parameters.
    """
    if not os.path.isfile(path):
        raise ValueError(f"mmproj: {path!r} is not a file")
    f = GGUFFile(path)
    md = f.metadata
    arch = md.get("general.architecture")
    if arch != MMPROJ_ARCH:
        f.close()
        raise ValueError(f"mmproj: {path} is not an mmproj file (general.architecture {arch!r}, expected "
                         f"{MMPROJ_ARCH!r}: a text model?)")
    ptype = md.get("clip.vision.projector_type") or md.get("clip.projector_type")
    if not md.get("clip.has_vision_encoder", False) or ptype is None:
        f.close()
        raise ValueError(f"mmproj: {path} has no vision encoder (projector {ptype!r}); only image projectors load")
    if ptype not in PROJECTORS:
        f.close()
        raise ValueError(f"mmproj: {path}: projector type {ptype!r} is not supported (supported: {sorted(PROJECTORS)})")

    def need(key: str) -> int:
        v = md.get(key)
        if v is None:
            f.close()
            raise ValueError(f"mmproj: {path} lacks {key}")
        return int(v)

    image_size, patch = need("clip.vision.image_size"), need("clip.vision.patch_size")
    vcfg = {"hidden_size": need("clip.vision.embedding_length"),
            "intermediate_size": need("clip.vision.feed_forward_length"),
            "num_hidden_layers": need("clip.vision.block_count"),
            "num_attention_heads": need("clip.vision.attention.head_count"),
            "image_size": image_size, "patch_size": patch, "num_channels": 3,
            "layer_norm_eps": float(md.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            # NOTE: clip.use_gelu: llama.cpp's ggml_gelu is the tanh approximation (SigLIP's gelu_pytorch_tanh)
            "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
    scale = int(md.get("clip.vision.projector.scale_factor", 4))  # convert_hf_to_gguf writes it when != 4
    per_side = (image_size // patch) // scale
    if per_side < 1 or (image_size // patch) % scale:
        f.close()
        raise ValueError(f"mmproj: {path}: {image_size // patch} patches per side do not pool by {scale}")
    return MMProj(path=path, file=f, projector_type=ptype, vision_config=vcfg,
                  projection_dim=need("clip.vision.projection_dim"),
                  image_mean=_floats(md.get("clip.vision.image_mean"), [0.5, 0.5, 0.5]),
                  image_std=_floats(md.get("clip.vision.image_std"), [0.5, 0.5, 0.5]),
                  tokens_per_image=per_side * per_side)


def find_mmproj(model_path: str) -> str | None:
    """The ``mmproj*.gguf`` beside GGUF file ``model_path`` (module docstring for the rule), or None."""
    d = os.path.dirname(os.path.abspath(model_path))
    try:
        names = sorted(n for n in os.listdir(d) if n.lower().startswith("mmproj") and n.lower().endswith(".gguf"))
    except OSError:
        return None
    names = [n for n in names if os.path.join(d, n) != os.path.abspath(model_path)]
    if not names:
        return None
    f16 = [n for n in names if re.search(r"(?<!b)f16", n.lower())]
    pick = (f16 or names)[0]
    if len(names) > 1:
        logger.info("pagedllm: mmproj: %d candidates beside the model (%s); using %s (pass --mmproj to choose)",
                    len(names), ", ".join(names), pick)
    return os.path.join(d, pick)


def _vocab_ids(tokenizer: Any, text_file: GGUFFile) -> dict[str, int]:
    """Ids of Gemma 3's image markers in the tokenizer (or the GGUF vocabulary without one)."""
    out = {}
    vocab = tokenizer.get_vocab() if tokenizer is not None else None
    tokens = None if vocab is not None else text_file.metadata.get("tokenizer.ggml.tokens")
    for attr, tok in GEMMA3_TOKENS.items():
        if vocab is not None:
            i = vocab.get(tok)
        else:
            i = tokens.index(tok) if tokens is not None and tok in tokens else None
        if i is None:
            raise ValueError(f"mmproj: the text model's vocabulary has no {tok!r} (not a Gemma 3 vision model?)")
        out[attr] = int(i)
    return out


def attach_mmproj(lm: Any, text_file: GGUFFile, proj: MMProj, dtype: Any = None) -> None:
    """Make ``lm`` (a GGUF ``LoadedModel``) the image-text model of its text GGUF plus ``proj``: the config
    becomes ``Gemma3ForConditionalGeneration``'s (``architectures`` set, the full HF config as a dict in
    ``mm_parent_config``, as ``hf_loader.text_model_config`` leaves it for safetensors), ``weights()`` yields
    the text tensors then the vision ones (in ``dtype``, default float32), and ``lm.mmproj`` holds ``proj`` (the image processor's source).

    Raises:
        ValueError: the projector does not fit the text model (architecture, or its output size differs from
            the text hidden size: an mmproj of another model), or the vocabulary lacks the image markers.
    """
    archs, hf_arch = PROJECTORS[proj.projector_type]
    cfg = lm.hf_config
    if text_file.architecture not in archs:
        raise ValueError(f"mmproj: {proj.path}: a {proj.projector_type!r} projector does not fit a "
                         f"{text_file.architecture!r} text model ({os.path.basename(lm.model_path)})")
    if proj.projection_dim != int(cfg.hidden_size):
        raise ValueError(f"mmproj: {proj.path}: projector output size {proj.projection_dim} != the text model's "
                         f"hidden size {cfg.hidden_size} (an mmproj of another model?)")
    proj.token_ids = _vocab_ids(lm.tokenizer, text_file)
    text = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    cfg.mm_parent_config = {
        "model_type": "gemma3", "architectures": [hf_arch], "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", **proj.vision_config},
        "mm_tokens_per_image": proj.tokens_per_image, "image_token_id": proj.token_ids["image_token"],
        "image_token_index": proj.token_ids["image_token"], "boi_token_index": proj.token_ids["boi_token"],
        "eoi_token_index": proj.token_ids["eoi_token"],
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", True))}
    cfg.architectures = [hf_arch]
    lm.mmproj = proj
    text_weights = lm.weights

    def weights():
        yield from text_weights()
        import torch

        yield from proj.weights(dtype or torch.float32)

    lm.weights = weights


def resolve_mmproj(lm: Any, text_file: GGUFFile, mmproj: str | None, dtype: Any = None) -> None:
    """``load_model``'s hook for a GGUF text model: attach ``mmproj`` (a path), or the auto-detected file when
    ``mmproj`` is None; ``"none"`` (any case) or "" attaches nothing.

    Raises:
        ValueError: an explicit ``mmproj`` that cannot be opened or does not fit (``open_mmproj``,
            ``attach_mmproj``); a detected one is skipped with a warning instead.
    """
    if mmproj is not None and mmproj.strip().lower() in ("", "none"):
        return
    explicit = mmproj is not None
    path = mmproj if explicit else find_mmproj(lm.model_path)
    if path is None:
        return
    try:
        attach_mmproj(lm, text_file, open_mmproj(path), dtype)
    except ValueError as e:
        if explicit:
            raise
        logger.warning("pagedllm: %s; serving text only (auto-detected beside the model; --mmproj none turns "
                       "the detection off)", e)
        return
    logger.info("pagedllm: mmproj %s: %s vision tower + projector (%d image tokens per %dpx image)", path,
                lm.mmproj.projector_type, lm.mmproj.tokens_per_image, lm.mmproj.vision_config["image_size"])


def check_mmproj_arg(model_path: str, mmproj: str | None) -> None:
    """``pagedllm serve``'s preflight: an explicit ``--mmproj`` is an mmproj file of a supported projector
    whose output size and architecture fit GGUF ``model_path`` (headers only, no tensors read).

    Raises:
        ValueError: worded for ``pagedllm serve: error: <message>``.
    """
    if mmproj is None or mmproj.strip().lower() in ("", "none"):
        return
    if not (os.path.isfile(model_path) and model_path.lower().endswith(".gguf")):
        raise ValueError(f"--mmproj: needs a GGUF text model; {model_path!r} is not a .gguf file")
    proj = open_mmproj(mmproj)
    text = GGUFFile(model_path)
    try:
        archs, _ = PROJECTORS[proj.projector_type]
        hidden = text.arch_get("embedding_length")
        if text.architecture not in archs:
            raise ValueError(f"--mmproj: a {proj.projector_type!r} projector does not fit the "
                             f"{text.architecture!r} text model {os.path.basename(model_path)}")
        if hidden is not None and int(hidden) != proj.projection_dim:
            raise ValueError(f"--mmproj: {os.path.basename(mmproj)} outputs {proj.projection_dim}-wide embeddings, "
                             f"the text model's hidden size is {int(hidden)} (an mmproj of another model?)")
    finally:
        text.close()
        proj.file.close()
