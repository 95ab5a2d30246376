"""Choose the attention backend for a device.

Default: "torch" on CPU, "triton" on CUDA. ``override`` (e.g. from ``--attention-backend``) or
the ``PAGEDLLM_ATTENTION_BACKEND`` environment variable (the argument wins) picks one explicitly:
"torch", "triton" or "flashinfer" (only if the ``flashinfer`` package is importable; there is no
FlashInfer implementation in pagedllm yet, so it currently raises with a clear message).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

import torch

from pagedllm.attention.backend import AttentionImpl

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDLLM_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton", "flashinfer")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def get_attn_backend_name(device: torch.device | str, override: Optional[str] = None) -> str:
    """Name of the backend to use on ``device``.

    Raises:
        ValueError: unknown name, a backend whose package is missing, or "triton"/"flashinfer" on
            a CPU device without ``TRITON_INTERPRET=1`` (Triton only runs on CPU in its interpreter).
    """
    device = torch.device(device)
    name = (override or os.environ.get(ENV_VAR) or "").strip().lower() or None
    if name is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend: must be one of {list(BACKENDS)}, got {name!r}")
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend 'triton': the triton package is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' on CPU needs TRITON_INTERPRET=1 (the slow "
                             "interpreter, meant for tests); use 'torch' on CPU")
    if name == "flashinfer":
        if not flashinfer_available():
            raise ValueError("attention backend 'flashinfer': the flashinfer package is not importable")
        if device.type != "cuda":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device")
    return name


def get_attn_backend(device: torch.device | str, override: Optional[str] = None) -> AttentionImpl:
    """An ``AttentionImpl`` instance for ``device`` (see ``get_attn_backend_name``)."""
    name = get_attn_backend_name(device, override)
    logger.info("pagedllm: attention backend %s on %s", name, torch.device(device))
    if name == "torch":
        from pagedllm.attention.torch_paged import TorchPagedAttention
        return TorchPagedAttention()
    if name == "triton":
        from pagedllm.attention.triton_paged import TritonPagedAttention
        return TritonPagedAttention()
    raise ValueError("attention backend 'flashinfer': not implemented in pagedllm yet; use 'triton'")
