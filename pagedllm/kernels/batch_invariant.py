"""Batch-invariant CPU kernels (``csrc/batch_invariant.cpp``): build, load, and the mode switch.

In batch-invariant mode every number a request's tokens produce (hidden states, logits,
logprobs) depends only on that request's own tokens: not on the other requests in the step,
on where its prefill was split into chunks, on whether its K/V came from the prefix cache or
were just computed, or on a preemption and recompute. The default kernels do not promise
that: oneDNN/MKL pick GEMM kernels by M (a row of a 1-row product differs from the same row in
a 4-row product), and decode and prefill attention sum in different orders. vLLM users report
the same (vllm-project/vllm#23138, #7845); vLLM's answer is ``VLLM_BATCH_INVARIANT=1``.

The kernels are compiled as their own extension module, without ``-ffast-math`` and with
``-ffp-contract=off`` (the main kernel module is built with ``-ffast-math``, which lets the
compiler reassociate sums differently in each place a function is inlined). The module is
cached like the main one (``pagedllm.kernels.cpu_ops``): ``$PAGEDLLM_CACHE_DIR/kernels``, keyed
by source, flags, torch, Python and CPU.

Turn the mode on with ``LLM(batch_invariant=True)``, ``pagedllm serve --batch-invariant``, or
the environment (``PAGEDLLM_BATCH_INVARIANT=1``, or vLLM's ``VLLM_BATCH_INVARIANT=1``).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from pagedllm.kernels.cpu_ops import LazyExtension

logger = logging.getLogger("pagedllm")

ENV_VARS = ("PAGEDLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")
_SRC = os.path.join(os.path.dirname(__file__), "csrc", "batch_invariant.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-fast-math", "-ffp-contract=off"]
#: ``act_mul`` kinds by activation name (``pagedllm.models.layers.ACTIVATIONS``).
ACT_KINDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 2}

#: no torch fallback, so ``PAGEDLLM_CPU_KERNELS=0`` does not switch it off; the failure is raised by
#: ``get_bi_ops``, not warned about.
_BI_OPS = LazyExtension([_SRC], "pagedllm_bi_ops", "the batch-invariant CPU kernels", _CFLAGS,
                        optional=False, on_error=lambda e: None)


def batch_invariant_from_env() -> bool:
    """Whether ``PAGEDLLM_BATCH_INVARIANT`` or ``VLLM_BATCH_INVARIANT`` is set to a true value
    (``1``, ``true``, ``yes``, ``on``; anything else, or unset, is false)."""
    return any((os.environ.get(v) or "").strip().lower() in ("1", "true", "yes", "on") for v in ENV_VARS)


def get_bi_ops() -> Any:
    """The compiled module (``linear``, ``attention``, ``act_mul``, ``isa``).

    Raises:
        RuntimeError: the module cannot be built here (no compiler or headers); the message
            says why. Batch-invariant mode has no torch fallback.
    """
    ops = _BI_OPS.get()
    if ops is None:
        raise RuntimeError(f"batch_invariant: the batch-invariant CPU kernels could not be built ({_BI_OPS.error}); "
                           f"they need a C++ compiler and the torch headers")
    return ops


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` whose rows do not depend on how many rows ``x`` has.

    Args:
        x: ``[..., K]`` float32 or bfloat16 (CPU).
        weight: ``[N, K]``, x's dtype; bias: ``[N]`` or None, x's dtype.

    Returns:
        ``[..., N]`` in x's dtype: per element one FMA chain per vector lane over K in order,
        then a fixed pairwise sum of the lanes, then the bias (see the C++ source).

    Raises:
        RuntimeError: other dtypes or devices, mismatched shapes, or no kernels.
    """
    lead = x.shape[:-1]
    out = get_bi_ops().linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*lead, weight.shape[0])
