"""HF model directories: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
from collections.abc import Iterator

import torch


SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
_PT_SKIP = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state", "scaler.pt")


def _indexed(path: str, index_name: str) -> list[str] | None:
    """The shard files an index (`weight_map` values) lists, as paths; None without an index.
    Raises ValueError naming a listed shard that is missing."""
    index = os.path.join(path, index_name)
    if not os.path.isfile(index):
        return None
    with open(index) as fh:
        names = sorted(set(json.load(fh).get("weight_map", {}).values()))
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise ValueError(f"{path!r}: {index_name} lists shard(s) {missing} that are not in the directory")
    return [os.path.join(path, n) for n in names]


def safetensors_files(path: str, ignore_patterns: list[str] | None = None) -> list[str]:
    """Sorted `*.safetensors` files in directory `path`, minus those whose file name matches any of
    `ignore_patterns` (fnmatch, e.g. ["consolidated*", "*.bak.safetensors"]). With a
    `model.safetensors.index.json`, exactly the shards it lists (a stray `*.safetensors` beside them,
    e.g. a `consolidated.safetensors` copy, is not loaded: vLLM's rule)."""
    files = _indexed(path, SAFETENSORS_INDEX)
    if files is None:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    pats = ignore_patterns or []
    return [f for f in files if not any(fnmatch.fnmatch(os.path.basename(f), p) for p in pats)]


def pt_files(path: str, ignore_patterns: list[str] | None = None) -> list[str]:
    """PyTorch checkpoint files (`*.bin` / `*.pt`; the shards `pytorch_model.bin.index.json` lists when
    present; training state such as `training_args.bin` skipped), minus `ignore_patterns`."""
    files = _indexed(path, PT_INDEX)
    if files is None:
        files = sorted(f for f in glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
                       if not os.path.basename(f).startswith(_PT_SKIP))
    pats = ignore_patterns or []
    return [f for f in files if not any(fnmatch.fnmatch(os.path.basename(f), p) for p in pats)]


def iter_pt_weights(files: list[str], dtype: torch.dtype | None = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `iter_safetensors_weights` for PyTorch checkpoints (`torch.load(weights_only=True, mmap=True)`:
    no pickled code runs); `dtype=None` converts nothing."""
    from tqdm import tqdm

    for fname in tqdm(files, desc="Loading pt checkpoint shards", unit="shard", disable=not files):
        state = torch.load(fname, map_location="cpu", weights_only=True, mmap=True)
        for name, t in state.items():
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t


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


def hf_weight_files(path: str, ignore_patterns: list[str] | None = None, load_format: str = "auto") -> tuple[str, list[str]]:
    """`(format, files)` of an HF model directory: safetensors (`safetensors_files`) or, for
    `load_format` "pt" (or "auto" without safetensors), PyTorch files (`pt_files`); "dummy" needs none.
    Raises ValueError naming the directory and what is missing."""
    if load_format == "dummy":
        return "dummy", []
    if load_format in ("auto", "safetensors"):
        files = safetensors_files(path, ignore_patterns)
        if files or load_format == "safetensors":
            return "safetensors", check_hf_dir(path, ignore_patterns)
    files = pt_files(path, ignore_patterns)
    if not files:
        if load_format == "auto":
            return "safetensors", check_hf_dir(path, ignore_patterns)  # NOTE: its error names what is missing
        raise ValueError(f"{path!r} has no PyTorch checkpoint files (*.bin / *.pt) to load (load_format='pt')")
    return "pt", files


def load_hf_config(path: str, hf_overrides: dict | None = None):
    """`AutoConfig.from_pretrained(path)` (reads config.json) with `hf_overrides` applied
    (`pagedllm.config.apply_hf_overrides`); for a multimodal checkpoint served as text (`text_model_config`), its text
    config. Never runs a checkpoint's own Python code.

    Raises:
        ValueError: the config needs custom code (`auto_map` for a model type transformers does not know).
    """
    from transformers import AutoConfig

    from pagedllm.config import apply_hf_overrides

    try:
        config = AutoConfig.from_pretrained(path)
    except ValueError:
        auto_map = _config_json(path).get("auto_map")
        if auto_map:
            raise ValueError(
                f"{path}: config.json needs the checkpoint's own Python code ({auto_map.get('AutoConfig', auto_map)}) "
                f"for model_type {_config_json(path).get('model_type')!r}, which transformers does not know. "
                "pagedllm never executes a checkpoint's code (--trust-remote-code is accepted for vLLM "
                "compatibility but runs nothing); serve a checkpoint of an architecture transformers or "
                "pagedllm implements") from None
        raise
    return text_model_config(apply_hf_overrides(config, hf_overrides))


def _config_json(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def text_model_config(config):
    """`config`, or for a multimodal config without top-level text fields (e.g. `Gemma3Config`) its text
    config (`get_text_config()`) carrying the top-level `architectures` (so the registry still picks the
    multimodal class, which builds the text decoder) and `tie_word_embeddings`. The engine reads
    `vocab_size`, `max_position_embeddings`, ... from the result."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if get_text is not None else config
    # NOTE (vlm2): a stray top-level "vocab_size" (llava-hf's config.json keeps one beside text_config)
    # does not make the top level a text config; its layers must be there too
    if text is config or ("vocab_size" in config.__dict__ and "num_hidden_layers" in config.__dict__):
        return config
    text.architectures = list(getattr(config, "architectures", None) or [])
    # NOTE: a plain dict (the text config is part of the full one: no reference cycle); the
    # multimodal model rebuilds the full config from it for its vision tower
    text.mm_parent_config = config.to_dict()
    if "tie_word_embeddings" in config.__dict__:
        text.tie_word_embeddings = config.tie_word_embeddings
    return text


def load_generation_config(path: str) -> dict:
    """The contents of `generation_config.json` in `path` as a dict, or {} if absent."""
    p = os.path.join(path, "generation_config.json")
    if not os.path.isfile(p):
        return {}
    with open(p) as fh:
        return json.load(fh)


# safetensors dtype names (https://github.com/huggingface/safetensors, "Format") -> torch dtypes
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
              "U64": "uint64"}


def mapped_safetensors(fname: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of safetensors file `fname`, each a view of one private
    (copy-on-write) `mmap` of the file: no host copy is made here, the caller's copy into its
    parameter is the only one. The mapping lives as long as any view does.

    Format (safetensors "Format"): u64 little-endian header size N, N bytes of JSON
    `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data
    (offsets relative to its start), little endian, C order.
    Raises ValueError for a header that does not parse or a tensor outside the file, or a dtype
    this torch does not have (the caller falls back to `safe_open`)."""
    import json
    import mmap
    import struct

    with open(fname, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        n = struct.unpack_from("<Q", mm, 0)[0]
        header = json.loads(bytes(mm[8:8 + n]))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{fname}: not a safetensors file ({e})") from None
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = getattr(torch, _ST_DTYPES.get(info.get("dtype"), ""), None)
        begin, end = info["data_offsets"]
        if not isinstance(dt, torch.dtype) or base + end > len(mm) or begin > end:
            raise ValueError(f"{fname}: tensor {name}: dtype {info.get('dtype')} or offsets {begin}..{end}")
        entries.append((name, dt, tuple(info["shape"]), base + begin, end - begin))
    entries.sort(key=lambda e: e[0])  # NOTE: safe_open's order (sorted names), which loaders have always seen
    raw = torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
    for name, dt, shape, off, nbytes in entries:
        t = raw[off:off + nbytes]
        yield name, (t.view(dt).reshape(shape) if nbytes else torch.empty(shape, dtype=dt))


def iter_safetensors_weights(files: list[str], dtype: torch.dtype | None = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in `files`, one at a time, floating tensors converted to `dtype`
    (integer / bool tensors, e.g. quantization metadata, are yielded unchanged; with `dtype=None` nothing is
    converted). Names are the checkpoint's own (HF names, e.g. "model.layers.0.self_attn.q_proj.weight").

    Tensors in the requested dtype are views of the mapped file (`mapped_safetensors`: no host copy before
    the model's own); a file the mapped reader cannot take is read with `safe_open` (one copy per tensor)."""
    from tqdm import tqdm

    for fname in tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard", disable=not files):
        try:
            tensors = mapped_safetensors(fname)
            first = next(tensors, None)
        except (ValueError, OSError):
            tensors, first = _safe_open_tensors(fname), None
        if first is not None:
            tensors = _chain(first, tensors)
        for name, t in tensors:
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t


def _chain(first, rest):
    yield first
    yield from rest


def _safe_open_tensors(fname: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(fname, framework="pt") as fh:
        for name in fh.keys():
            yield name, fh.get_tensor(name)


def tensor_files(files: list[str], names: set[str] | None = None) -> dict[str, str]:
    """Map tensor name -> the safetensors file (path) holding it (reads headers only).
    With `names`, only those tensors are looked up."""
    from safetensors import safe_open

    out: dict[str, str] = {}
    for fname in files:
        with safe_open(fname, framework="pt") as fh:
            for name in fh.keys():
                if names is None or name in names:
                    out.setdefault(name, fname)
    return out


def describe_unexpected_tensors(model_path: str, unexpected: list[str], model_name: str = "the model",
                                ignore_patterns: list[str] | None = None, limit: int = 20) -> str:
    """An error message naming each safetensors file in `model_path` that holds tensors the model does not have,
    with those tensor names, and how to skip the file on purpose (`ignore_patterns` / `--ignore-patterns`)."""
    import os

    files = safetensors_files(model_path, ignore_patterns)
    where = tensor_files(files, set(unexpected))
    by_file: dict[str, list[str]] = {}
    for name in unexpected:
        by_file.setdefault(os.path.basename(where.get(name, "?")), []).append(name)
    parts = []
    for fname, names in sorted(by_file.items()):
        shown = sorted(names)[:limit]
        more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
        parts.append(f"file {fname!r} holds {len(names)} tensor(s) that {model_name} does not have: {shown}{more}")
    files_named = sorted(f for f in by_file if f != "?")
    hint = (f"; remove the file(s), or skip them on purpose with ignore_patterns={files_named} "
            f"(--ignore-patterns {' '.join(files_named)})") if files_named else ""
    return f"{model_path}: " + "; ".join(parts) + hint


_UNEXPECTED_PREFIX = "unexpected checkpoint tensors: "


def annotate_load_error(err: ValueError, loaded, ignore_patterns: list[str] | None = None,
                        model_name: str = "the model") -> ValueError:
    """`err` from `model.load_weights` rewritten to name the safetensors file(s) holding the unexpected tensors
    (HF directories only; any other error is returned unchanged)."""
    import ast

    msg = str(err)
    if getattr(loaded, "source", None) != "hf" or not msg.startswith(_UNEXPECTED_PREFIX):
        return err
    try:
        names = list(ast.literal_eval(msg[len(_UNEXPECTED_PREFIX):]))
    except (ValueError, SyntaxError):
        return err
    return ValueError(describe_unexpected_tensors(loaded.model_path, names, model_name, ignore_patterns))


def check_checkpoint_files(model, model_path: str, files: list[str], skip_names: tuple[str, ...] = (),
                           ignore_patterns: list[str] | None = None) -> None:
    """Before loading: every tensor of every safetensors file must be a parameter of `model` that no other tensor
    provides. Names are mapped like `model.load_weights` does (`model.` prefix optional, q/k/v and gate/up packed).
    A head saved beside the encoder (e.g. `norm.weight`, `fc1.weight` in head.safetensors) would otherwise be
    rejected only in part, or silently overwrite the model's own `norm.weight`.

    Raises ValueError naming each offending file and its tensors (unknown ones, and ones another file already
    provides), and how to skip the file on purpose (`ignore_patterns` / `--ignore-patterns`)."""
    import os

    from safetensors import safe_open

    if not hasattr(model, "_canonical_name"):  # the transformers fallback: transformers checks its own loading
        return
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    no_head = getattr(model, "lm_head", "absent") is None
    providers: dict[str, list[tuple[str, str]]] = {}  # canonical name -> [(file, checkpoint name)]
    valid: dict[str, int] = {}
    unknown: dict[str, list[str]] = {}
    dup: dict[str, list[str]] = {}
    for fname in files:
        base = os.path.basename(fname)
        with safe_open(fname, framework="pt") as fh:
            names = list(fh.keys())
        for name in names:
            if name in skip_names:
                continue
            canon = model._canonical_name(name)
            if canon is None or (canon == "lm_head.weight" and no_head):
                continue
            if hasattr(model, "param_target"):
                target = model.param_target(canon)[0]
            else:
                target = canon
                for ckpt, (fused, _sid) in packed.items():
                    if f".{ckpt}." in canon:
                        target = canon.replace(f".{ckpt}.", f".{fused}.")
                        break
            if target not in params:
                unknown.setdefault(base, []).append(name)
            else:
                providers.setdefault(canon, []).append((base, name))
                valid[base] = valid.get(base, 0) + 1
    for _canon, prov in providers.items():
        if len(prov) > 1:
            # The file holding most of the model keeps the tensor; the others are blamed.
            keep = max(prov, key=lambda fp: (valid.get(fp[0], 0), fp[0] not in unknown))
            for base, name in prov:
                if (base, name) != keep:
                    dup.setdefault(base, []).append(f"{name} (also in {keep[0]} as {keep[1]})")
    if not unknown and not dup:
        return
    parts = []
    model_name = type(model).__name__
    for base in sorted(set(unknown) | set(dup)):
        bits = []
        if unknown.get(base):
            u = sorted(unknown[base])
            bits.append(f"{len(u)} tensor(s) that {model_name} does not have: {u[:20]}"
                        + (f" (+{len(u) - 20} more)" if len(u) > 20 else ""))
        if dup.get(base):
            d = sorted(dup[base])
            bits.append(f"{len(d)} tensor(s) another file already provides: {d[:20]}"
                        + (f" (+{len(d) - 20} more)" if len(d) > 20 else ""))
        parts.append(f"file {base!r} holds " + " and ".join(bits))
    names = sorted(set(unknown) | set(dup))
    raise ValueError(f"{model_path}: " + "; ".join(parts) + f"; remove the file(s), or skip them on purpose with "
                     f"ignore_patterns={names} (--ignore-patterns {' '.join(names)})")
