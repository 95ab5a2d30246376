"""The C++ CPU kernels as the model layers see them (vLLM's ``_custom_ops`` role).

``models/`` asks here for one kernel by name and falls back to its torch code when the answer is
None; which extension module holds the kernel, how it is built and whether it is enabled
(``PAGEDLLM_CPU_KERNELS=0``) stay in ``pagedllm.kernels.cpu_ops``, the owner.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from pagedllm.kernels import cpu_ops


def cpu_op(name: str) -> Optional[Callable[..., Any]]:
    """The C++ CPU kernel ``name`` (e.g. ``"rms_norm"``, ``"rotary_inplace"``), or None when the
    kernels are disabled, failed to build, or this build has no such function.

    The extension is looked up on every call through ``cpu_ops.get_ops`` (which caches the built
    module), so a test that patches ``cpu_ops.get_ops`` reaches every caller.
    """
    ops = cpu_ops.get_ops()
    return None if ops is None else getattr(ops, name, None)
