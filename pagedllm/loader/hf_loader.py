"""HF model directories: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from collections.abc import Iterator

import torch


def safetensors_files(path: str, ignore_patterns: list[str] | None = None) -> list[str]:
    """Sorted `*.safetensors` files in directory `path`, minus those whose file name matches any of
    `ignore_patterns` (fnmatch, e.g. ["consolidated*", "*.bak.safetensors"])."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    pats = ignore_patterns or []
    return [f for f in files if not any(fnmatch.fnmatch(os.path.basename(f), p) for p in pats)]


def check_hf_dir(path: str, ignore_patterns: list[str] | None = None) -> list[str]:
    """Validate an HF model directory; return its safetensors files.
    Raises ValueError naming the directory and what is missing (config.json and/or *.safetensors)."""
    missing = []
    if not os.path.isfile(os.path.join(path, "config.json")):
        missing.append("config.json")
    files = safetensors_files(path, ignore_patterns)
    if not files:
        what = "*.safetensors files"
        if ignore_patterns and safetensors_files(path):
            what += f" (all excluded by ignore_patterns={ignore_patterns})"
        missing.append(what)
    if missing:
        raise ValueError(f"{path!r} is not a loadable HF model directory: missing {' and '.join(missing)}")
    return files


def load_hf_config(path: str):
    """`AutoConfig.from_pretrained(path)` (reads config.json)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_generation_config(path: str) -> dict:
    """The contents of `generation_config.json` in `path` as a dict, or {} if absent."""
    p = os.path.join(path, "generation_config.json")
    if not os.path.isfile(p):
        return {}
    with open(p) as fh:
        return json.load(fh)


def iter_safetensors_weights(files: list[str], dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in `files`, one at a time, floating tensors converted to `dtype`
    (integer / bool tensors, e.g. quantization metadata, are yielded unchanged). Names are the checkpoint's own
    (HF names, e.g. "model.layers.0.self_attn.q_proj.weight")."""
    from safetensors import safe_open

    for fname in files:
        with safe_open(fname, framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)
                yield name, t
