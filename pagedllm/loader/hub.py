"""Hugging Face Hub model ids -> local files, through ``huggingface_hub`` (its cache layout,
``HF_HUB_OFFLINE``, ``HF_TOKEN``, ``HF_HUB_CACHE`` / ``HF_HOME``).

Accepted forms (vLLM's):

- ``org/name``: a checkpoint repo; weights in the order safetensors, PyTorch ``.bin``/``.pt``, GGUF
  (``load_format`` "auto"), or the one format ``load_format`` names;
- ``org/name:QUANT``: the GGUF file of quantization ``QUANT`` in a GGUF repo
  (``unsloth/Qwen3-0.6B-GGUF:Q4_K_M``);
- ``org/name/file.gguf``: that GGUF file of the repo.

The HF cache comes first: a revision whose snapshot is cached with the files needed is used without
any network access; otherwise the files are downloaded (``snapshot_download``, with its progress
bars), unless ``HF_HUB_OFFLINE`` is set, in which case a missing repo or revision is a ValueError
naming it. Only the files to load are fetched: config, tokenizer and generation files, and the
weight files of one format (for a sharded safetensors checkpoint exactly the shards its
``model.safetensors.index.json`` lists).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Optional
from pagedllm import envs

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Non-weight files a model needs: config, generation config, tokenizer files, chat templates.
META_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
_PT_SKIP = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state", "scaler.pt")


@dataclass
class HubModel:
    """A resolved Hub model: ``path`` is the local snapshot directory, or the ``.gguf`` file in it
    (``load_format`` "gguf"); ``load_format`` is the format chosen."""

    repo_id: str
    revision: Optional[str]
    path: str
    load_format: str


def parse_model_ref(model: str) -> Optional[tuple[str, Optional[str], Optional[str]]]:
    """``(repo_id, gguf file, gguf quant)`` for a Hub reference, or None if ``model`` is not one.

    ``"org/name"`` -> ``("org/name", None, None)``; ``"org/name:Q4_K_M"`` -> ``("org/name", None, "Q4_K_M")``;
    ``"org/name/sub/f.gguf"`` -> ``("org/name", "sub/f.gguf", None)``.
    """
    ref, quant = model.strip(), None
    if ":" in ref:
        ref, _, quant = ref.rpartition(":")
        if not quant or "/" in quant:
            return None
    parts = ref.split("/")
    if len(parts) > 2 and parts[-1].lower().endswith(".gguf") and quant is None:
        repo, gguf = "/".join(parts[:2]), "/".join(parts[2:])
    else:
        repo, gguf = ref, None
    if not _REPO_ID.match(repo) or ".." in repo:
        return None
    return repo, gguf, quant


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (read now, not at import: huggingface_hub reads it once when imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir(download_dir: Optional[str] = None) -> str:
    """``download_dir``, else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


DEFAULT_ENDPOINT = "https://huggingface.co"


def _probe(host: str, port: int, timeout: float) -> Optional[str]:
    """None if a TCP connection to ``host:port`` opens within ``timeout`` seconds (name lookup
    included, which ``socket`` cannot time out: it runs in a daemon thread), else why not."""
    import socket
    import threading

    result: list[Optional[str]] = ["timed out"]

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result[0] = None
        except OSError as e:
            result[0] = e.strerror or str(e) or type(e).__name__

    t = threading.Thread(target=attempt, daemon=True, name="pagedllm-hub-probe")
    t.start()
    t.join(timeout + 0.5)
    return result[0] if not t.is_alive() else f"no answer in {timeout:g} s"


def check_hub_reachable(model: str, cache_dir: str) -> None:
    """Fail fast (a few seconds, ``PAGEDLLM_HUB_CONNECT_TIMEOUT``, default 3) when ``model`` must be
    downloaded but the Hub (``HF_ENDPOINT``, or the ``HTTPS_PROXY`` in between) cannot be reached,
    instead of waiting on huggingface_hub's retries.

    Raises:
        ValueError: naming the model, the cache directory searched, ``HF_HUB_OFFLINE=1`` and the
            local-path alternative.
    """
    from urllib.parse import urlsplit

    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    if endpoint.startswith("https"):
        proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    else:
        proxy = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
    target = urlsplit(proxy if proxy else endpoint)
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        timeout = float(envs.get("PAGEDLLM_HUB_CONNECT_TIMEOUT"))
    except ValueError:
        timeout = 3.0
    why = _probe(host, port, timeout) if host else "no host in HF_ENDPOINT"
    if why is None:
        return
    via = f" through the proxy {host}:{port}" if proxy else ""
    raise ValueError(
        f"model {model!r} is not in the Hugging Face cache ({cache_dir}) and the Hub ({endpoint}) cannot be "
        f"reached{via} ({why}). Connect to the network, or set HF_HUB_OFFLINE=1 to use only the cache "
        "(--download-dir or HF_HUB_CACHE names another one), or pass a local path: a .gguf file or a "
        "model directory with config.json")


def _token() -> Optional[str]:
    return os.environ.get("HF_TOKEN") or None


def cached_snapshot(repo_id: str, revision: Optional[str], cache_dir: str) -> tuple[Optional[str], str]:
    """``(snapshot directory or None, why not)`` for ``repo_id`` at ``revision`` (a branch, tag or
    commit; None = "main") in the cache laid out as huggingface_hub lays it out
    (``models--org--name/{refs/<rev>, snapshots/<commit>/}``)."""
    from huggingface_hub.file_download import repo_folder_name

    folder = os.path.join(cache_dir, repo_folder_name(repo_id=repo_id, repo_type="model"))
    if not os.path.isdir(folder):
        return None, f"repository {repo_id!r} is not in the Hugging Face cache {cache_dir}"
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else None
    ref = os.path.join(folder, "refs", rev)
    if commit is None and os.path.isfile(ref):
        with open(ref) as fh:
            commit = fh.read().strip()
    snap = os.path.join(folder, "snapshots", commit) if commit else None
    if snap is None or not os.path.isdir(snap):
        return None, f"revision {rev!r} of {repo_id!r} is not in the Hugging Face cache {cache_dir}"
    return snap, ""


def _files_under(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        for n in names:
            out.append(os.path.relpath(os.path.join(root, n), path).replace(os.sep, "/"))
    return sorted(out)


def _remote_files(repo_id: str, revision: Optional[str]) -> list[str]:
    """The repo's file list from the Hub. Raises ValueError naming a missing repo or revision."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return sorted(HfApi().list_repo_files(repo_id, revision=revision, token=_token()))
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r}: revision {revision!r} not found on the Hugging Face Hub") from None
    except GatedRepoError:
        raise ValueError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms and set HF_TOKEN"
                         ) from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id!r}: no such repository on the Hugging Face Hub (a private repo needs "
                         "HF_TOKEN)") from None


def _select(files: list[str], repo_id: str, load_format: str, gguf: Optional[str], quant: Optional[str],
            index: Optional[dict]) -> tuple[str, list[str]]:
    """``(format, weight files)`` among the repo's ``files``. Raises ValueError when none fits."""
    top = [f for f in files if "/" not in f]
    st = [f for f in top if f.endswith(".safetensors")]
    pt = [f for f in top if f.endswith((".bin", ".pt")) and not f.startswith(_PT_SKIP)]
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if gguf is not None or quant is not None:
        load_format = "gguf"
    if load_format == "dummy":
        return "dummy", []
    if load_format in ("auto", "safetensors") and st:
        if index is not None:
            return "safetensors", sorted(set(index.get("weight_map", {}).values()))
        return "safetensors", st
    if load_format in ("auto", "pt") and pt:
        return "pt", pt
    if load_format in ("auto", "gguf") and ggufs:
        if gguf is not None:
            if gguf not in ggufs:
                raise ValueError(f"model {repo_id!r} has no file {gguf!r} (GGUF files: {ggufs})")
            return "gguf", [gguf]
        if quant is not None:
            pat = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(quant)}([^A-Za-z0-9]|$)", re.IGNORECASE)
            match = [f for f in ggufs if pat.search(os.path.basename(f))]
            if len(match) != 1:
                raise ValueError(f"model {repo_id!r}: {'no' if not match else 'more than one'} GGUF file for "
                                 f"quantization {quant!r} (GGUF files: {ggufs})")
            return "gguf", match
        if len(ggufs) > 1:
            raise ValueError(f"model {repo_id!r} holds several GGUF files {ggufs}: pick one with "
                             f"'{repo_id}:QUANT' (e.g. '{repo_id}:Q4_K_M') or '{repo_id}/<file>.gguf'")
        return "gguf", ggufs
    want = {"auto": "safetensors, .bin/.pt or .gguf", "safetensors": ".safetensors", "pt": ".bin/.pt",
            "gguf": ".gguf"}[load_format]
    raise ValueError(f"model {repo_id!r} has no {want} weight files (load_format={load_format!r}; files: {files[:20]})")


def _needed(snapshot_files: list[str], fmt: str, weights: list[str]) -> list[str]:
    """Files a snapshot must hold: config.json (not for GGUF) and the weights."""
    need = list(weights)
    if fmt != "gguf":
        need.append("config.json")
    return [f for f in need if f not in snapshot_files]


def resolve_hub_model(model: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
                      load_format: str = "auto") -> HubModel:
    """Local files for Hub reference ``model`` (see the module doc).

    Raises:
        ValueError: not a Hub reference; a repo / revision / file that does not exist, or is not cached
            while offline (each named); no weights of the format asked for.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    ref = parse_model_ref(model)
    if ref is None:
        raise ValueError(f"{model!r} is not a Hugging Face Hub model id (org/name[:QUANT] or org/name/file.gguf)")
    repo_id, gguf, quant = ref
    cache_dir = hub_cache_dir(download_dir)
    snap, why = cached_snapshot(repo_id, revision, cache_dir)
    offline = is_offline()
    if snap is not None:
        files = _files_under(snap)
        index = _read_index(os.path.join(snap, "model.safetensors.index.json"))
        try:
            fmt, weights = _select(files, repo_id, load_format, gguf, quant, index)
        except ValueError:
            if offline:
                raise
        else:
            if not _needed(files, fmt, weights):
                return _result(repo_id, revision, snap, fmt, weights)
            if offline:
                raise ValueError(f"model {repo_id!r} (revision {revision or 'main'!r}): the cached snapshot {snap} "
                                 f"lacks {_needed(files, fmt, weights)} and HF_HUB_OFFLINE is set")
    elif offline:
        raise ValueError(f"model {model!r}: {why}, and HF_HUB_OFFLINE is set (no download)")
    return _download(repo_id, revision, cache_dir, load_format, gguf, quant)


def _read_index(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _result(repo_id, revision, snap, fmt, weights) -> HubModel:
    path = os.path.join(snap, weights[0]) if fmt == "gguf" else snap
    return HubModel(repo_id, revision, path, fmt)


def _download(repo_id: str, revision: Optional[str], cache_dir: str, load_format: str, gguf: Optional[str],
              quant: Optional[str]) -> HubModel:
    from huggingface_hub import hf_hub_download, snapshot_download

    check_hub_reachable(repo_id, cache_dir)
    files = _remote_files(repo_id, revision)
    index = None
    if "model.safetensors.index.json" in files and load_format in ("auto", "safetensors") and not (gguf or quant):
        index = _read_index(hf_hub_download(repo_id, "model.safetensors.index.json", revision=revision,
                                            cache_dir=cache_dir, token=_token()))
    fmt, weights = _select(files, repo_id, load_format, gguf, quant, index)
    allow = list(weights) if fmt == "gguf" else META_PATTERNS + list(weights)
    snap = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow, token=_token())
    return _result(repo_id, revision, snap, fmt, weights)


def resolve_hub_files(repo_id: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
                      patterns: Optional[list[str]] = None) -> str:
    """A snapshot directory of ``repo_id`` holding the files matching ``patterns`` (default: config
    and tokenizer files), for ``--tokenizer`` / ``--hf-config-path`` given as repo ids; cache first,
    as ``resolve_hub_model``. Raises ValueError naming a missing repo or revision."""
    patterns = patterns or META_PATTERNS
    cache_dir = hub_cache_dir(download_dir)
    snap, why = cached_snapshot(repo_id, revision, cache_dir)
    if snap is not None and any(fnmatch.fnmatch(f, p) for f in _files_under(snap) for p in patterns):
        return snap
    if is_offline():
        raise ValueError(f"{repo_id!r}: {why or 'no matching files in the cached snapshot'}, and HF_HUB_OFFLINE "
                         "is set (no download)")
    from huggingface_hub import snapshot_download

    check_hub_reachable(repo_id, cache_dir)
    _remote_files(repo_id, revision)  # NOTE: a clear error for a missing repo or revision
    return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns,
                             token=_token())
