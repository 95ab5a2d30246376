"""Optional C++ CPU kernels, compiled once with ``torch.utils.cpp_extension`` and cached.

* ``paged_decode_attention`` (``csrc/paged_decode.cpp``) reads K/V straight from the paged
  cache through the block table, instead of gathering every request's context into a
  contiguous copy each step (which dominated the decode step in the pure-torch path, see
  docs/performance.md).
* ``quantize_rows_int8``, ``rms_norm_quant``, ``dequant_int32``, ``dequant_silu_mul_quant``
  (``csrc/quant_ops.cpp``): the one-pass element-wise work around the int8 GEMMs of W8A8
  quantization (``pagedllm.quantization.w8a8``, which holds their torch references).
* ``int8_gemm_packed`` (``csrc/int8_gemm.cpp``): the int8 GEMM of W8A8 for decode-sized M, on
  weights packed once at load (AVX512-VNNI; ``int8_gemm_supported()`` says whether it was built).
* ``rotary_inplace``, ``reshape_and_cache``, ``rms_norm`` (``csrc/layer_ops.cpp``): rope on q/k
  in place, the K/V store into the paged cache, and RMSNorm with the residual add folded in,
  each one pass (torch references: ``RotaryEmbedding.forward``, ``attention.torch_paged.write_kv``,
  ``RMSNorm.forward``).
* ``llama_decode_w8a8``, ``llama_decode_dense`` (``csrc/fused_decode.cpp``): the decoder layers
  of a decode-only Llama step (W8A8, resp. float weights) in one call, stringing the kernels above
  (and for float weights the same ATen / oneDNN linear) together in the module path's order
  (``pagedllm.worker.fused_decode``).
* ``install_cpu_allocator`` (``csrc/cpu_allocator.cpp``): a caching allocator for large CPU
  blocks, installed as torch's CPU allocator by ``install_cpu_allocator()`` below.

If the compiler
or headers are missing, ``get_ops()`` returns None and callers use the torch path.
``PAGEDLLM_CPU_KERNELS=0`` disables the kernels.

The build runs in a private temporary directory and the finished ``.so`` is moved
atomically into ``$PAGEDLLM_CACHE_DIR/kernels`` (default ``~/.cache/pagedllm/kernels``) under
a name keyed by the source, torch version and flags: checkouts never rebuild each other's
kernel, and an interrupted build leaves no lock behind for the next start to wait on.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional
from pagedllm import envs

logger = logging.getLogger("pagedllm")

_SRCS = [os.path.join(os.path.dirname(__file__), "csrc", f)
         for f in ("paged_decode.cpp", "quant_ops.cpp", "layer_ops.cpp", "int8_gemm.cpp", "cpu_allocator.cpp",
                    "fused_decode.cpp", "bindings.cpp")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _cache_dir() -> str:
    base = envs.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return os.path.join(base, "kernels")


def _module_name(srcs: Optional[list[str]] = None, prefix: str = "pagedllm_cpu_ops",
                 cflags: Optional[list[str]] = None) -> str:
    import torch

    h = hashlib.sha256()
    srcs = _SRCS if srcs is None else srcs
    for src in srcs + [os.path.join(os.path.dirname(srcs[0]), h) for h in ("cpu_utils.h", "torch_lite.h")]:
        with open(src, "rb") as f:
            h.update(f.read())
    h.update(torch.__version__.encode())
    h.update(" ".join(_CFLAGS if cflags is None else cflags).encode())
    h.update(sys.version.encode())
    h.update(_cpu_model().encode())  # -march=native code is only valid on this CPU model
    return f"{prefix}_{h.hexdigest()[:16]}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _import_so(name: str, path: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


# What a failed build costs, said in the one-line warning (decode on the pure-torch path).
SLOW_PATH_NOTE = "the engine will run ~11x slower on the pure-torch path"


def compile_extension(name: str, so_path: str, srcs: list[str], what: str, cflags: Optional[list[str]] = None) -> Any:
    """Compile ``srcs`` into the extension ``name``, cache it at ``so_path`` and import it.

    Prints one progress line to stderr (shown from scripts/install.sh, ``pagedllm serve`` and
    ``LLM()`` alike, whatever the logging setup): ``pagedllm: compiling <what> (first run only)
    ...`` completed with the elapsed time on success, or with ``failed after N s`` (the caller
    says what that means).

    Args:
        name: the extension module's name (keyed by source, torch, flags and CPU).
        so_path: where the built ``.so`` is cached (moved there atomically).
        srcs: the C++ sources.
        what: a few words naming the extension in the progress line.
        cflags: compiler flags (default: this module's ``-O3 -march=native -fopenmp -ffast-math``).

    Raises:
        Exception: whatever ``torch.utils.cpp_extension.load`` raises (no compiler, no headers,
            a compile error).
    """
    from torch.utils.cpp_extension import load

    print(f"pagedllm: compiling {what} (first run only; cached in {os.path.dirname(so_path)}) ...",
          end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="pagedllm-build-") as tmp:
            mod = load(name=name, sources=srcs, build_directory=tmp, extra_cflags=_CFLAGS if cflags is None else cflags,
                       extra_ldflags=["-fopenmp"], verbose=False)
            os.makedirs(os.path.dirname(so_path), exist_ok=True)
            staged = f"{so_path}.{os.getpid()}.tmp"
            shutil.copyfile(mod.__file__, staged)
            os.replace(staged, so_path)
            # the build directory goes away below: point __file__ at the cached copy of the same
            # bytes (objdump and other tools read the module's file)
            mod.__file__ = so_path
    except BaseException:
        print(f" failed after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return mod


def load_extension(srcs: list[str], prefix: str, what: str, cflags: Optional[list[str]] = None) -> Any:
    """The extension built from ``srcs``: imported from the kernel cache when a build of these
    exact sources, flags, torch, Python and CPU is there, else compiled (``compile_extension``).

    Args:
        srcs: the C++ sources. prefix: the module name's prefix (the cache key's hash follows).
        what: a few words naming it in the progress line. cflags: compiler flags (default
            ``_CFLAGS``).

    Raises:
        Exception: whatever the build raises (the callers warn once and use the torch path).
    """
    name = _module_name(srcs, prefix, cflags)
    so_path = os.path.join(_cache_dir(), name + ".so")
    if os.path.exists(so_path):
        try:
            return _import_so(name, so_path)
        except ImportError as e:  # corrupt or foreign file: rebuild
            logger.warning("pagedllm: cached kernel %s unusable (%s); rebuilding", so_path, e)
    return compile_extension(name, so_path, srcs, what, cflags)


def build_failed_message(what: str, err: BaseException) -> str:
    """The one-line warning for a kernel build that failed: what failed, the first line of why,
    and what it costs (``SLOW_PATH_NOTE``)."""
    first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    why = f"{type(err).__name__}: {first}"[:200]
    return (f"pagedllm: WARNING: {what} could not be built ({why}); {SLOW_PATH_NOTE} "
            f"(install g++ and restart; PAGEDLLM_CPU_KERNELS=0 silences this)")


def _warn_build_failed(what: str, err: BaseException) -> None:
    logger.debug("kernel build failed", exc_info=err)
    print(build_failed_message(what, err), file=sys.stderr, flush=True)


class LazyExtension:
    """One JIT-built extension module, loaded (``load_extension``) on the first ``get()`` and kept
    for the process; thread-safe, one attempt per process.

    Args:
        srcs, prefix, what, cflags: as for ``load_extension``.
        optional: ``PAGEDLLM_CPU_KERNELS=0`` disables it (``get()`` then returns None without
            building); False for a module with no torch fallback, which the variable does not
            switch off.
        on_error: called once with the exception when the build fails (default: the one-line
            ``build_failed_message`` warning on stderr).

    Attributes:
        ops: the module, or None (not tried yet, disabled, or failed). tried: whether ``get()``
        has run. error: ``"Type: message"`` of the failed build, else None.
    """

    def __init__(self, srcs: list[str], prefix: str, what: str, cflags: Optional[list[str]] = None, *,
                 optional: bool = True, on_error: Optional[Callable[[BaseException], None]] = None) -> None:
        self.srcs, self.prefix, self.what, self.cflags = srcs, prefix, what, cflags
        self.optional = optional
        self.on_error = on_error or (lambda e: _warn_build_failed(what, e))
        self.ops: Any = None
        self.tried = False
        self.error: Optional[str] = None
        self._lock = threading.Lock()

    def get(self) -> Optional[Any]:
        """The module, built or loaded from the kernel cache on the first call; None when
        disabled or the build failed (``on_error`` has then been called, once)."""
        if self.tried:
            return self.ops
        with self._lock:
            if self.tried:
                return self.ops
            self.tried = True
            if self.optional and not envs.get("PAGEDLLM_CPU_KERNELS"):
                return None
            try:
                import torch  # noqa: F401  (the extension links against libtorch)

                self.ops = load_extension(self.srcs, self.prefix, self.what, self.cflags)
            except Exception as e:  # no compiler / headers: callers use their fallback
                self.error = f"{type(e).__name__}: {e}"
                self.on_error(e)
            return self.ops

    def built(self) -> Optional[Any]:
        """The module if ``get()`` has already loaded it, else None (never triggers a build)."""
        return self.ops if self.tried else None


DEFAULT_ALLOCATOR_MIN_BYTES = 1 << 20
DEFAULT_ALLOCATOR_CACHE_BYTES = 1 << 30


def install_cpu_allocator() -> bool:
    """Make torch's CPU allocator keep freed blocks of >= 1 MiB for reuse (once per process).

    glibc maps every allocation above 32 MiB afresh and unmaps it on free, so such a tensor
    pays ~0.4 s/GB of page faults on first touch; W8A8 prefill of 8,192 tokens spent ~1.1 s of
    5.5 s that way (benchmarks/results/performance-history-2026-11.md,
    step 22). At most ``PAGEDLLM_CPU_ALLOCATOR_CACHE``
    bytes (a size string such as ``512MiB``; default 1 GiB) of free blocks are kept;
    ``PAGEDLLM_CPU_ALLOCATOR=0`` leaves torch's allocator in place.
    ``PAGEDLLM_CPU_ALLOCATOR_HUGEPAGES=1`` advises new blocks for transparent huge pages
    (decode attention ~5% faster on a cache in huge pages, but start-up 0.2-2.5 s slower while
    the kernel compacts memory to find them).

    Returns:
        True if the allocator is installed (now or before), False if disabled or the kernels
        are unavailable.

    Raises:
        ValueError: ``PAGEDLLM_CPU_ALLOCATOR_CACHE`` is not a byte size.
    """
    if not envs.get("PAGEDLLM_CPU_ALLOCATOR"):
        return False
    ops = get_ops()
    if ops is None or not hasattr(ops, "install_cpu_allocator"):
        return False
    cache_bytes = (envs.get("PAGEDLLM_CPU_ALLOCATOR_CACHE") if envs.is_set("PAGEDLLM_CPU_ALLOCATOR_CACHE")
                   else DEFAULT_ALLOCATOR_CACHE_BYTES)
    huge = bool(envs.get("PAGEDLLM_CPU_ALLOCATOR_HUGEPAGES"))
    if ops.install_cpu_allocator(DEFAULT_ALLOCATOR_MIN_BYTES, int(cache_bytes), huge):
        logger.debug("pagedllm: caching CPU allocator installed (keeps up to %d bytes of free blocks)", cache_bytes)
    return True


def cpu_allocator_stats() -> dict[str, int]:
    """The caching CPU allocator's counters, or ``{}`` when it is not installed.

    Keys: ``cached_bytes`` (free blocks kept for reuse, at most ``max_cached_bytes``),
    ``live_bytes`` (blocks held by tensors), ``hits`` / ``misses`` (allocations served from the
    cache / freshly mapped), ``min_bytes``, ``max_cached_bytes``, ``huge_pages``. Bytes are
    whole 2 MiB-rounded blocks.
    """
    ops = _CPU_OPS.built()
    if ops is None or not hasattr(ops, "cpu_allocator_stats"):
        return {}
    return dict(ops.cpu_allocator_stats())


def cpu_allocator_empty_cache() -> None:
    """Return the caching CPU allocator's free blocks to the OS (no-op when not installed)."""
    ops = _CPU_OPS.built()
    if ops is not None and hasattr(ops, "cpu_allocator_empty_cache"):
        ops.cpu_allocator_empty_cache()


_CPU_OPS = LazyExtension(_SRCS, "pagedllm_cpu_ops", "the C++ CPU kernels")


def get_ops() -> Optional[Any]:
    """The compiled extension module, or None when disabled or it failed to build."""
    return _CPU_OPS.get()


# ----------------------------------------------------------------------------- quantized-weight GEMMs
# A second, small extension module (``csrc/group_gemm.cpp``): the GEMM on group-quantized weights
# kept in their checkpoint's precision (GGUF blocks, GPTQ/AWQ, compressed-tensors, FP8; see
# ``pagedllm.quantization.group_quant``). NOTE: its own module so that it builds in seconds and
# changing it does not rebuild the kernels above.
_QUANT_SRCS = [os.path.join(os.path.dirname(__file__), "csrc", "group_gemm.cpp")]
_QUANT_OPS = LazyExtension(_QUANT_SRCS, "pagedllm_quant_ops", "the quantized-weight GEMM kernels")


def get_quant_ops() -> Optional[Any]:
    """The compiled ``group_gemm`` extension (``group_gemm``, ``group_dequantize``,
    ``group_gemm_avx2``), or None when disabled (``PAGEDLLM_CPU_KERNELS=0``) or it failed to build
    (callers then use the torch path)."""
    return _QUANT_OPS.get()


# ----------------------------------------------------------------------------- integer-dot GEMM
# A third small module (``csrc/intdot_gemm.cpp``): the decode-sized GEMM on the group layout's int4 /
# int8 kinds (groups of 32) with int8-quantized activations and integer block dots. NOTE: built
# without -march=native (and without -ffast-math, with -ffp-contract=off): its AVX2 and AVX512-VNNI
# paths are compiled per function and chosen at run time, so one build serves every x86 CPU and all
# paths do the same float operations.
_INTDOT_SRCS = [os.path.join(os.path.dirname(__file__), "csrc", "intdot_gemm.cpp")]
_INTDOT_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_INTDOT_OPS = LazyExtension(
    _INTDOT_SRCS, "pagedllm_intdot_ops", "the integer-dot GEMM kernel", _INTDOT_CFLAGS,
    on_error=lambda e: logger.warning("pagedllm: integer-dot C++ kernel unavailable (%s); group_gemm runs instead", e))


def get_intdot_ops() -> Optional[Any]:
    """The compiled ``intdot_gemm`` extension (``intdot_gemm``, ``intdot_quantize``,
    ``intdot_isa_supported``, ``intdot_best_isa``, ``intdot_isa_name``), or None when disabled
    (``PAGEDLLM_CPU_KERNELS=0``) or it failed to build (callers then use ``group_gemm``)."""
    return _INTDOT_OPS.get()
