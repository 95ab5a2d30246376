"""Model loading: GGUF files and HF safetensors directories -> config, weights, tokenizer.

    lm = load_model("SmolLM2-135M-Instruct")          # or a .gguf path, or an HF directory
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
from typing import Any

import torch

from .resolve import get_gemma3_gguf_path, get_smollm2_gguf_path, known_models, resolve_model_path

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
    model_path: the resolved .gguf file or HF directory.
    source: "gguf" or "hf".
    generation_config: contents of generation_config.json (HF dirs), else {}.
    """

    hf_config: Any
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Any
    model_path: str
    source: str
    generation_config: dict = field(default_factory=dict)


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    tokenizer: str | None = None,
    ignore_patterns: list[str] | None = None,
    load_tokenizer: bool = True,
) -> LoadedModel:
    """Resolve `model` (known name, .gguf path or HF directory) and load its config and tokenizer; weights are
    read lazily when `LoadedModel.weights()` is iterated.

    dtype: floating dtype of the yielded weights (GGUF tensors are dequantized to float32 first).
    tokenizer: optional tokenizer source (HF directory / name or .gguf file) overriding the model's own.
    ignore_patterns: fnmatch patterns of safetensors file names to skip (HF directories only).
    load_tokenizer: False leaves `tokenizer` None (a tensor/pipeline-parallel rank that never detokenizes).
    Raises ValueError for unknown names, unsupported GGUF architectures, or HF directories lacking config.json /
    safetensors.
    """
    want_tokenizer = load_tokenizer  # NOTE: before the import below rebinds the name
    from .tokenizer import load_tokenizer

    path = resolve_model_path(model)
    if os.path.isdir(path):
        from .hf_loader import check_hf_dir, iter_safetensors_weights, load_generation_config, load_hf_config

        files = check_hf_dir(path, ignore_patterns)
        config = load_hf_config(path)
        tok = load_tokenizer(tokenizer or path) if want_tokenizer else None
        return LoadedModel(
            hf_config=config,
            weights=lambda: iter_safetensors_weights(files, dtype),
            tokenizer=tok,
            model_path=path,
            source="hf",
            generation_config=load_generation_config(path),
        )

    from .gguf_file import GGUFFile
    from .gguf_loader import gguf_config, iter_gguf_weights

    gf = GGUFFile(path)
    config = gguf_config(gf)
    tok = load_tokenizer(tokenizer or path) if want_tokenizer else None
    return LoadedModel(
        hf_config=config,
        weights=lambda: iter_gguf_weights(gf, config, dtype),
        tokenizer=tok,
        model_path=path,
        source="gguf",
        generation_config={},
    )
