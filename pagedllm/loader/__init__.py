"""Model loading: GGUF files, HF checkpoint directories and Hugging Face Hub ids -> config, weights, tokenizer.

    lm = load_model("SmolLM2-135M-Instruct")          # or a .gguf path, an HF directory, or "org/name" (hub.py)
    lm.hf_config.architectures  -> ["LlamaForCausalLM"]
    for name, tensor in lm.weights(): ...             # HF names, dequantized, lm.dtype... one at a time

Config quirks (transformers 5.x): rope theta lives in `config.rope_parameters["rope_theta"]` (LlamaConfig,
Qwen2/3Config; there is no `config.rope_theta` attribute). Gemma3TextConfig has
`rope_parameters = {"sliding_attention": {"rope_theta": 10000.0, ...}, "full_attention": {"rope_theta": 1e6, ...}}`,
`layer_types` (list of "sliding_attention" / "full_attention", length num_hidden_layers), `sliding_window`,
`query_pre_attn_scalar`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .resolve import get_gemma3_gguf_path, get_smollm2_gguf_path, known_models, resolve_model_path

if TYPE_CHECKING:  # NOTE: torch is imported when a model loads, not with the package (fast CLI checks)
    import torch

__all__ = [
    "LoadedModel",
    "load_model",
    "resolve_model_path",
    "get_gemma3_gguf_path",
    "get_smollm2_gguf_path",
    "known_models",
]


@dataclass
class LoadedModel:
    """Everything needed to build and run a model.

    hf_config: model config with `.architectures` set (e.g. ["LlamaForCausalLM"], ["Gemma3ForCausalLM"]).
        HF directories: the transformers config (LlamaConfig, Qwen2Config, ...). GGUF files: a `TextConfig`
        (text_config.py) with the same attributes and values the transformers config would have (LlamaConfig,
        Gemma3TextConfig, Qwen2Config, Qwen3Config), built without importing transformers;
        `.to_transformers()` / `.to_dict()` give transformers' own.
    weights: call it to get a fresh iterator of (HF tensor name, tensor) pairs, produced lazily one at a time:
        dequantized, converted to the requested dtype, HF layout ([out, in] for linear weights). For tied
        embeddings (config.tie_word_embeddings) no "lm_head.weight" is yielded from GGUF files.
    tokenizer: transformers fast tokenizer; `.chat_template` is None when the model has none.
    model_path: the resolved .gguf file or HF directory (a Hub model's snapshot directory in the HF cache).
    source: "gguf" or "hf".
    generation_config: contents of generation_config.json (HF dirs), else {}.
    load_format: the weights' format: "safetensors", "pt", "gguf" or "dummy" (no weights: the engine fills
        the parameters with small random values, vLLM's dummy format).
    repo_id: the Hugging Face Hub repo the model came from, or None.
    mmproj: a GGUF model's vision side from an mmproj file (`loader.gguf_mmproj.MMProj`), or None.
    quant_config: the `pagedllm.quantization` config the weights load with (`loader.quant_config`), or None
        for float weights. With one, `weights()` yields what its methods take: GGUF blocks as
        `GGUFRawTensor`s (GGUFConfig), HF tensors in their checkpoint dtype (no float cast). Setting it to
        None on a GGUF model before `weights()` is called dequantizes at load instead.
    """

    hf_config: Any
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Any
    model_path: str
    source: str
    generation_config: dict = field(default_factory=dict)
    load_format: str = "safetensors"
    repo_id: str | None = None
    quant_config: Any = None
    mmproj: Any = None


def _no_weights() -> Iterator[tuple[str, torch.Tensor]]:
    return iter(())


def _local_or_hub(name: str, revision: str | None, download_dir: str | None, patterns: list[str] | None = None) -> str:
    """A local path as is, else the snapshot directory of Hub repo `name` (config / tokenizer files)."""
    from .hub import parse_model_ref, resolve_hub_files

    if os.path.exists(name) or parse_model_ref(name) is None:
        return name
    return resolve_hub_files(name, revision, download_dir, patterns)


def load_model(
    model: str,
    dtype: torch.dtype | None = None,
    tokenizer: str | None = None,
    ignore_patterns: list[str] | None = None,
    quantization: str | None = "none",
    load_tokenizer: bool = True,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
    tokenizer_revision: str | None = None,
    hf_overrides: dict | None = None,
    hf_config_path: str | None = None,
    mmproj: str | None = None,
) -> LoadedModel:
    """Resolve `model` (known name, .gguf path, HF directory or Hugging Face Hub id) and load its config and
    tokenizer; weights are read lazily when `LoadedModel.weights()` is iterated.

    dtype: floating dtype of the yielded weights (default float32; GGUF tensors are dequantized to float32 first).
    tokenizer: optional tokenizer source (HF directory, Hub id or .gguf file) overriding the model's own;
        `tokenizer_revision` is its Hub revision.
    ignore_patterns: fnmatch patterns of weight file names to skip (HF directories only).
    load_tokenizer: False leaves `tokenizer` None (a tensor/pipeline-parallel rank that never detokenizes).
    revision, download_dir: the Hub revision (branch, tag or commit) and HF cache directory (`hub.py`).
    load_format: "auto", "safetensors", "pt", "gguf" or "dummy" (vLLM's `--load-format`).
    hf_overrides: config attributes to override (vLLM's `--hf-overrides`, `pagedllm.config.apply_hf_overrides`),
        applied to the checkpoint's full config (for a multimodal one, before its text config is taken).
    hf_config_path: an HF config directory or Hub id to use instead of the model's own config (e.g. for a GGUF
        file, whose metadata otherwise gives the config).
    mmproj: for a GGUF file, llama.cpp's mmproj GGUF with the vision tower and projector (`loader.gguf_mmproj`;
        None: an `mmproj*.gguf` beside the model is used when it fits, "none": text only).
    quantization: the `--quantization` value, see `loader.quant_config`: None = the checkpoint's own format (what
        the engine passes when the flag is unset: GGUF blocks kept quantized, GPTQ, ...); the default "none" gives
        float weights (GGUF dequantized by `weights()`; an HF quantized checkpoint's config with
        `dequantize_after_load`).
    Raises ValueError for unknown names or Hub ids, missing files, unsupported GGUF architectures, a
    `load_format` the files do not match, a config that needs custom code, or a quantization the checkpoint
    cannot load with.
    """
    want_tokenizer = load_tokenizer  # NOTE: before the import below rebinds the name
    if dtype is None:
        import torch

        dtype = torch.float32
    from pagedllm.config import apply_hf_overrides

    from .hf_loader import load_hf_config
    from .hub import LOAD_FORMATS, parse_model_ref, resolve_hub_model
    from .quant_config import resolve_quant_config
    from .tokenizer import load_tokenizer

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    repo_id = None
    try:
        path = resolve_model_path(model)
    except ValueError:
        if os.path.exists(model) or parse_model_ref(model) is None:
            raise
        hub = resolve_hub_model(model, revision, download_dir, load_format)
        path, repo_id = hub.path, hub.repo_id
        if hub.load_format != "dummy":
            load_format = hub.load_format
    tok_src = _local_or_hub(tokenizer, tokenizer_revision, download_dir) if tokenizer and want_tokenizer else None
    cfg_src = _local_or_hub(hf_config_path, revision, download_dir) if hf_config_path else None
    if mmproj and mmproj.strip().lower() != "none" and os.path.isdir(path):
        raise ValueError(f"mmproj: needs a GGUF text model; {path!r} is an HF directory (its own vision tower loads)")
    if os.path.isdir(path):
        from .hf_loader import hf_weight_files, iter_pt_weights, iter_safetensors_weights, load_generation_config

        if load_format == "gguf":
            raise ValueError(f"load_format='gguf' needs a .gguf file; {path!r} is a directory")
        fmt, files = hf_weight_files(path, ignore_patterns, load_format)
        config = load_hf_config(cfg_src or path, hf_overrides)
        quant = resolve_quant_config("hf", config, quantization)
        tok = load_tokenizer(tok_src or path) if want_tokenizer else None
        reader = {"safetensors": iter_safetensors_weights, "pt": iter_pt_weights}.get(fmt)
        # NOTE: a quantized checkpoint's tensors keep their dtype (fp16 scales, fp8 weights): the
        # model's parameters cast the float ones, the methods convert the rest.
        wdtype = dtype if quant is None or quant.on_the_fly else None
        return LoadedModel(
            hf_config=config,
            weights=(lambda: reader(files, wdtype)) if reader else _no_weights,
            tokenizer=tok,
            model_path=path,
            source="hf",
            generation_config=load_generation_config(path),
            load_format=fmt,
            repo_id=repo_id,
            quant_config=quant,
        )

    from .gguf_file import GGUFFile
    from .gguf_loader import gguf_config, iter_gguf_weights

    if load_format in ("safetensors", "pt"):
        raise ValueError(f"load_format={load_format!r} needs an HF model directory; {path!r} is a GGUF file")
    gf = GGUFFile(path)
    config = load_hf_config(cfg_src, hf_overrides) if cfg_src else apply_hf_overrides(gguf_config(gf), hf_overrides)
    dummy = load_format == "dummy"
    quant = None if dummy else resolve_quant_config("gguf", config, quantization, gguf_file=gf)
    tok = load_tokenizer(tok_src or path) if want_tokenizer else None
    gf.drop_vocab()  # read by the config and the tokenizer only; `weights` below keeps `gf` (issue 30.4)
    lm = LoadedModel(hf_config=config, weights=_no_weights, tokenizer=tok, model_path=path, source="gguf",
                     generation_config={}, load_format="dummy" if dummy else "gguf", repo_id=repo_id,
                     quant_config=quant)

    def weights():
        # NOTE: read at iteration time: a caller may drop quant_config to dequantize at load instead
        q = lm.quant_config
        return iter_gguf_weights(gf, config, dtype, keep_quantized=q is not None and not q.on_the_fly)

    if not dummy:
        lm.weights = weights
    if mmproj is not None or not dummy:
        from .gguf_mmproj import resolve_mmproj

        resolve_mmproj(lm, gf, mmproj, dtype)  # GGUF + mmproj: the image-text model (gguf_mmproj.py)
    return lm
