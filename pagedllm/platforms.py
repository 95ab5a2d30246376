"""What the host offers: native bf16 matmul, CUDA, thread defaults."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512_BF16 or AMX-BF16 (bf16 matmul runs natively).

    Source: /proc/cpuinfo flags on Linux; False where that file is absent.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_device(device: str) -> torch.device:
    """Map "auto" | "cpu" | "cuda" to a torch.device.

    Raises:
        ValueError: unknown device name, or "cuda" without a CUDA device.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda")
    raise ValueError(f"device: must be one of 'auto', 'cpu', 'cuda', got {device!r}")


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map the ``dtype`` setting to a torch dtype.

    "auto" is bfloat16 on CUDA and on CPUs with native bf16 matmul (4.5x fp32 throughput
    on AVX512_BF16, docs/hardware-and-models.md "Measured ceilings"), else float32.

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype: must be one of 'auto', {sorted(_DTYPES)}, got {dtype!r}") from None


KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device,
                           dtype_setting: Optional[str | torch.dtype] = None,
                           batch_invariant: bool = False) -> torch.dtype:
    """Map the ``kv_cache_dtype`` setting (vLLM's names) to the KV cache's torch dtype.

    "auto" stores K/V in the model dtype, except on CPU when the model runs in float32 only
    because ``dtype`` was "auto" on a CPU without native bf16 matmul (``dtype_setting == "auto"``):
    then K/V are stored in bfloat16 (half the bytes per token; the C++ store rounds to nearest even
    and the decode kernel widens each row back to float32; ``tests/attention/test_kv_half.py``
    measures the difference against a float32 cache). An explicit ``dtype="float32"`` and
    batch-invariant mode keep a float32 cache. "bfloat16" asks for that cache under any model dtype
    on CPU (the model dtype's own on CUDA, bf16 models only). "fp8" (= "fp8_e4m3") stores
    ``torch.float8_e4m3fn`` and "fp8_e5m2" ``torch.float8_e5m2``: one byte per element, half of
    bf16, with a scale of 1.0 (vLLM's default when no scales are given); values beyond the format's
    largest finite value (448 for E4M3, 57344 for E5M2) saturate to it. Attention reads the 8-bit
    values widened to float32 (exact).

    Raises:
        ValueError: an unknown name, or a dtype the device's kernels do not read (CUDA).
    """
    if kv_cache_dtype == "auto":
        if (device.type == "cpu" and model_dtype == torch.float32 and dtype_setting == "auto"
                and not batch_invariant):
            return torch.bfloat16
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "bfloat16":
        if device.type != "cpu" and model_dtype != torch.bfloat16:
            raise ValueError(f"kv_cache_dtype: 'bfloat16' under a {str(model_dtype).replace('torch.', '')} model is "
                             f"supported on the CPU backend only (device {device.type!r}); use 'auto'")
        return torch.bfloat16
    if device.type != "cpu":
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is supported on the CPU backend only "
                         f"(device {device.type!r}); use 'auto'")
    return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn


def default_num_threads() -> int:
    """Engine torch threads when ``num_threads`` is not set.

    PAGEDLLM_NUM_THREADS / OMP_NUM_THREADS win when set; otherwise all cores, for the server too.
    Measured on 2 cores (docs/performance.md): ``pagedllm serve`` with 16 streaming clients gave
    222 output tok/s with 2 engine threads vs 165 with 1, so the HTTP side does not need a core
    of its own. An OpenMP team that loses a core to another CPU-busy *process* slows sharply on
    small ops, so on a shared host pass ``--num-threads`` (tests and CI use 1).
    """
    for var in ("PAGEDLLM_NUM_THREADS", "OMP_NUM_THREADS"):
        v = os.environ.get(var)
        if v and v.isdigit() and int(v) > 0:
            return int(v)
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n)


def trim_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc ``malloc_trim(0)``, see malloc_trim(3)).

    Free chunks inside glibc's heaps (e.g. what loading a checkpoint left behind) otherwise stay
    resident. Returns False where the C library has no ``malloc_trim`` (musl, macOS).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
