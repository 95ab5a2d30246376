"""Tokenizers: HF directories, and GGUF files via transformers' GGUF conversion with an on-disk cache.

Converting a GGUF vocab with transformers takes ~3 s (SmolLM2) / ~13 s (Gemma 3); the saved result reloads in
~0.3 s / ~2 s with identical ids (FACTS.md §3). The cache lives in
`<cache_dir>/tokenizers/<file stem>-<file size>-<sha256 of the first MiB, 16 hex>/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from .resolve import cache_dir


def _gguf_cache_key(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{os.path.getsize(path)}-{h.hexdigest()[:16]}"


def gguf_tokenizer_cache_path(path: str) -> str:
    """Directory where the converted tokenizer of GGUF file `path` is (or would be) cached."""
    return os.path.join(cache_dir(), "tokenizers", _gguf_cache_key(path))


def load_gguf_tokenizer(path: str, use_cache: bool = True):
    """Fast tokenizer for a GGUF file (vocab, merges/scores, special ids, add_bos, chat template from metadata).

    First call converts with `AutoTokenizer.from_pretrained(dir, gguf_file=name)` and saves it to the cache
    (written to a temp dir, then renamed, so concurrent processes never read a partial cache); later calls load
    the saved files. `chat_template` is None when the GGUF has no `tokenizer.chat_template`."""
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache_path(path) if use_cache else None
    if cached and os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached, **_load_bos_eos_flags(cached))
        except Exception:  # a broken cache entry: rebuild it below
            shutil.rmtree(cached, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    if cached:
        tmp = f"{cached}.tmp{os.getpid()}"
        try:
            tok.save_pretrained(tmp)
            _save_bos_eos_flags(tok, tmp)
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            os.replace(tmp, cached)
        except OSError:
            pass  # another process won the race (target dir exists and is non-empty) or the disk is read-only
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


_FLAGS_FILE = "pagedllm_flags.json"


def _save_bos_eos_flags(tok, saved_dir: str) -> None:
    """NOTE: transformers' GGUF conversion sets add_bos_token (True for Gemma) but from_pretrained drops
    add_bos/add_eos from tokenizer_config.json when a tokenizer.json exists, so a reloaded tokenizer reports
    add_bos_token=False (while its post-processor still adds BOS). We keep the flags in a side file and pass
    them back as kwargs on reload, which keeps the attribute truthful and the post-processor identical."""
    flags = {k: bool(getattr(tok, k)) for k in ("add_bos_token", "add_eos_token") if hasattr(tok, k)}
    with open(os.path.join(saved_dir, _FLAGS_FILE), "w") as fh:
        json.dump(flags, fh)


def _load_bos_eos_flags(saved_dir: str) -> dict:
    try:
        with open(os.path.join(saved_dir, _FLAGS_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def load_hf_tokenizer(name_or_path: str):
    """`AutoTokenizer.from_pretrained(name_or_path)` (fast tokenizer where available)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def load_tokenizer(name_or_path: str):
    """Tokenizer for a `.gguf` file (cached conversion) or an HF directory / name."""
    if name_or_path.lower().endswith(".gguf") and os.path.isfile(name_or_path):
        return load_gguf_tokenizer(name_or_path)
    return load_hf_tokenizer(name_or_path)
