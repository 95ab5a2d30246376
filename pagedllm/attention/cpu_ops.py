"""Optional C++ CPU kernels (compiled on first use with ``torch.utils.cpp_extension``).

``paged_decode_attention`` reads K/V straight from the paged cache through the block table,
instead of gathering every request's context into a contiguous copy each step (which
dominated the decode step in the pure-torch path, see docs/performance.md). If the compiler
or headers are missing, ``get_ops()`` returns None and callers use the torch path.
``PAGEDLLM_CPU_KERNELS=0`` disables the kernels.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

logger = logging.getLogger("pagedllm")

_lock = threading.Lock()
_ops: Any = None
_tried = False


def get_ops() -> Optional[Any]:
    """The compiled extension module, or None when disabled or it failed to build."""
    global _ops, _tried
    if _tried:
        return _ops
    with _lock:
        if _tried:
            return _ops
        _tried = True
        if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
            return None
        try:
            import time

            from torch.utils.cpp_extension import load

            src = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")
            t0 = time.perf_counter()
            _ops = load(name="pagedllm_cpu_ops", sources=[src],
                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                        extra_ldflags=["-fopenmp"], verbose=False)
            logger.info("pagedllm: CPU attention kernel ready in %.1f s", time.perf_counter() - t0)
        except Exception as e:  # no compiler / headers: the torch path still works
            logger.warning("pagedllm: C++ CPU kernels unavailable (%s); using the torch path", e)
            _ops = None
        return _ops
