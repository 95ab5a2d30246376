"""Tokenizers: HF directories, and GGUF files via transformers' GGUF conversion with an on-disk cache.

Converting a GGUF vocab with transformers takes ~3 s (SmolLM2) / ~13 s (Gemma 3); the saved result reloads in
~0.3 s / ~2 s with identical ids (docs/hardware-and-models.md "Tokenizers"). The cache lives in
`<cache_dir>/tokenizers/<file stem>-<file size>-<sha256 of the first MiB, 16 hex>/`.

Reloading the saved files is itself slow for Gemma 3 (~3 s: transformers parses the 33 MB tokenizer.json three
times in Python and rebuilds the BPE model from Python lists), so the reloaded tokenizer object is also kept as a
pickle snapshot beside the files (`snapshot-*.pkl`, keyed by the transformers / tokenizers / Python versions):
~1.3 s for Gemma 3 (the Rust tokenizer's own parse), ~0.1 s for SmolLM2, and the object is the same class with the
same state. NOTE: the snapshot is trusted like the rest of the cache dir (the compiled CPU kernels are loaded from
it too); a snapshot that fails to load is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys

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
    (written to a temp dir, then renamed, so concurrent processes never read a partial cache); the next call
    reloads the saved files and snapshots the result (see the module doc); later calls load the snapshot.
    `chat_template` is None when the GGUF has no `tokenizer.chat_template`."""
    cached = gguf_tokenizer_cache_path(path) if use_cache else None
    if cached and os.path.isfile(os.path.join(cached, "tokenizer.json")):
        tok = _load_snapshot(cached)
        if tok is not None:
            return drop_build_lists(tok)
        try:
            tok = drop_build_lists(_tokenizer_class(cached).from_pretrained(cached, **_load_bos_eos_flags(cached)))
        except Exception:  # a broken cache entry: rebuild it below
            shutil.rmtree(cached, ignore_errors=True)
        else:
            _save_snapshot(tok, cached)
            return tok
    from transformers import AutoTokenizer

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
    return drop_build_lists(tok)


_FLAGS_FILE = "pagedllm_flags.json"
#: Python copies of the vocabulary and merges that transformers' BPE tokenizers (Gemma, Llama, ...)
#: keep after building their Rust model from them, and never read again
_BUILD_LISTS = ("_vocab", "_merges")


def drop_build_lists(tok):
    """Drop the Python vocabulary / merges lists a fast tokenizer keeps once its Rust model is built
    (``GemmaTokenizer._vocab`` / ``_merges``: 262,144 entries and 514,906 pairs for Gemma 3, ~127 MiB
    of Python objects; transformers reads them only in ``__init__``). Encoding, decoding, chat
    templates and ``save_pretrained`` go through the Rust tokenizer. Returns ``tok``."""
    if getattr(tok, "_tokenizer", None) is not None:
        for name in _BUILD_LISTS:
            if isinstance(tok.__dict__.get(name), (dict, list)):
                tok.__dict__[name] = None
    return tok



def _snapshot_path(saved_dir: str) -> str:
    """`<saved_dir>/snapshot-<transformers>-<tokenizers>-py<X.Y>.pkl`: a pickle holds these packages' private
    object layout, so any version change gets a new file."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tag = f"{version('transformers')}-{version('tokenizers')}"
    except PackageNotFoundError:
        tag = "unknown"
    return os.path.join(saved_dir, f"snapshot-{tag}-py{sys.version_info[0]}.{sys.version_info[1]}.pkl")


def _load_snapshot(saved_dir: str):
    """The pickled tokenizer of a cache entry, or None (no snapshot, or one that does not load: it is removed)."""
    snap = _snapshot_path(saved_dir)
    if not os.path.isfile(snap):
        return None
    try:
        with open(snap, "rb") as fh:
            return pickle.load(fh)
    except Exception:  # truncated / incompatible snapshot: drop it, reload from the saved files
        try:
            os.remove(snap)
        except OSError:
            pass
        return None


def _save_snapshot(tok, saved_dir: str) -> None:
    """Pickle `tok` (as just reloaded from `saved_dir`) next to its files; written to a temp name and renamed, so
    a concurrent reader never sees a partial file. Errors (read-only disk, unpicklable tokenizer) are ignored."""
    snap = _snapshot_path(saved_dir)
    tmp = f"{snap}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            pickle.dump(tok, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, snap)
    except Exception:
        pass
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _tokenizer_class(saved_dir: str):
    """The class to reload a saved tokenizer directory with: `TokenizersBackend` itself when its
    tokenizer_config.json names that class (SmolLM2's converted tokenizer does), else `AutoTokenizer`.

    NOTE: `AutoTokenizer` ends up at the same class (same instance state) for such a directory, but importing it
    first builds transformers' import table of every model (~0.25 s of start-up); importing the class's own module
    does not. Anything else (e.g. Gemma's `GemmaTokenizer`, a remote-code `auto_map`) goes through AutoTokenizer."""
    try:
        with open(os.path.join(saved_dir, "tokenizer_config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in cfg:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


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
