"""Loaded weights served from a memory-mapped cache file instead of anonymous copies (issue 30.3).

Why a cache file and not the GGUF file itself: no kernel here reads llama.cpp's interleaved blocks.
A Q4_1 block is ``f16 d | f16 m | 16 bytes of nibbles`` (20 bytes per 32 values); the engine's group
layout (``quantization/group_quant.py``), which ``group_gemm.cpp`` and ``intdot_gemm.cpp`` read, keeps the
codes as one ``[N, K/2]`` nibble plane (llama.cpp's nibble order) and the scales / mins as separate
``[N, K/32]`` planes (float16 for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the file's own fields; float32 for the
K-quants); fused q|k|v and gate|up shards are stacked, and K-quants' 6-bit sub-block
scales are expanded. So the file's bytes are never the kernel's bytes (F32 norms aside, a few KiB).
Instead the loaded model's parameters (exactly what the kernels read) are written once to a cache file
and every later start maps that file: the weight pages are then file-backed and clean (``Shared_Clean``
/ ``Private_Clean`` in ``/proc/<pid>/smaps``), which the kernel can drop under pressure and read back,
and which several servers of the same model share, instead of anonymous copies.

The model still loads the usual way (GGUF blocks converted, shards merged); the cache only replaces where
the finished tensors live. On a hit every tensor is compared byte for byte with the one just loaded, so
a stale, truncated or corrupt file (a changed converter, another machine's file, a torn write) is never
used: it is rewritten. The mapped tensors are therefore bit-identical to the copies they replace.

Cache file (``<dir>/<key>.pwm``; key = sha256 of the checkpoint files' path, size and mtime, the load
options and ``LAYOUT_VERSION``)::

    magic b"PGLWMAP1" | u64 header length | JSON header | zero padding to 4096
    each tensor's bytes at its header ``offset`` (4096-aligned), ``nbytes`` long

JSON header: ``{"version": LAYOUT_VERSION, "key": ..., "tensors": [{"name", "dtype", "shape", "offset",
"nbytes"}, ...]}``. Files are written to ``<key>.pwm.tmp.<pid>`` and renamed into place (atomic on POSIX);
the mapping is private copy-on-write, so an in-place write by any code path only makes that page
anonymous again (never a change to the file).

Bound: the directory holds at most ``PAGEDLLM_WEIGHT_CACHE_MAX`` bytes (default 4 GiB; a size string
such as ``512MiB``): after writing a file, the least recently used others are deleted until the rest
fit; a model larger than the bound is not cached (its copies stay). ``PAGEDLLM_WEIGHT_MMAP=0`` turns
the cache off (copied weights, as before); ``PAGEDLLM_WEIGHT_CACHE_DIR`` moves it (default
``$XDG_CACHE_HOME/pagedllm/weights``, i.e. ``~/.cache/pagedllm/weights``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger("pagedllm")

#: bump when what the loader produces changes in a way the byte comparison should not have to catch
LAYOUT_VERSION = 3  # 2: GGUF Q4_0/Q4_1/Q5_x/Q8_0 scales and mins float16 (was float32); 3: + scales_il
MAGIC = b"PGLWMAP1"
ALIGN = 4096
SUFFIX = ".pwm"
#: parameters smaller than this stay copies (norm vectors: a page each in the file for nothing)
MIN_TENSOR_BYTES = 64 << 10
_U64 = struct.Struct("<Q")

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def mmap_enabled() -> bool:
    """Whether loaded weights may be served from the mapped cache (``PAGEDLLM_WEIGHT_MMAP`` not 0)."""
    from pagedllm import envs

    return envs.get("PAGEDLLM_WEIGHT_MMAP") != "0"


def cache_dir() -> str:
    """The cache directory: ``PAGEDLLM_WEIGHT_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm/weights``
    (``~/.cache/pagedllm/weights``)."""
    from pagedllm import envs

    d = envs.get("PAGEDLLM_WEIGHT_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedllm", "weights")


def cache_limit_bytes() -> int:
    """``PAGEDLLM_WEIGHT_CACHE_MAX`` in bytes (default 4 GiB). Raises ValueError (naming the
    variable) for a bad size string."""
    from pagedllm import envs

    return int(envs.get("PAGEDLLM_WEIGHT_CACHE_MAX"))


def cache_key(files: list[str], options: dict) -> str:
    """sha256 hex of the checkpoint ``files`` (real path, size, mtime in ns) and the load ``options``
    (dtype, quantization, ...: anything that changes the loaded tensors) and ``LAYOUT_VERSION``."""
    parts = []
    for p in files:
        st = os.stat(p)
        parts.append([os.path.realpath(p), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"v": LAYOUT_VERSION, "files": parts, "options": options}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class MappedWeights:
    """What ``map_model_weights`` did.

    Attributes:
        path: the cache file mapped, or None when nothing was mapped.
        mapped_bytes: bytes of parameters now served from the mapping.
        copied_bytes: bytes of parameters left as anonymous copies (small, non-contiguous, views).
        status: "hit" (an existing file matched), "written" (created or rebuilt), "rebuilt" (an
            existing file did not match and was replaced), "off", or "skipped: <why>".
        cache_bytes: bytes of ``.pwm`` files in the cache directory after pruning.
    """

    path: Optional[str] = None
    mapped_bytes: int = 0
    copied_bytes: int = 0
    status: str = "off"
    cache_bytes: int = 0
    _mm: list = field(default_factory=list, repr=False)

    def resident_bytes(self) -> int:
        """Resident bytes of the mapping now (its ``Rss`` in ``/proc/self/smaps``); 0 if unmapped."""
        if self.path is None:
            return 0
        return mapped_file_resident_bytes(self.path)


def mapped_file_resident_bytes(path: str) -> int:
    """Sum of ``Rss`` over this process's mappings of ``path`` (``/proc/self/smaps``, proc(5)), bytes;
    0 where ``/proc`` is unavailable."""
    real = os.path.realpath(path)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    inside = len(head) == 6 and head[5].strip() == real
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _candidates(model: nn.Module, min_bytes: int) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Unique parameters worth mapping, by storage (a tied weight once), and the bytes of the rest."""
    seen: dict[int, str] = {}
    out, rest = [], 0
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in seen:
            continue
        seen[key] = name
        nbytes = p.numel() * p.element_size()
        ok = (p.device.type == "cpu" and p.layout == torch.strided and p.is_contiguous() and nbytes >= min_bytes
              and p.storage_offset() == 0 and p.untyped_storage().nbytes() == nbytes
              and str(p.dtype).replace("torch.", "") in _DTYPES)
        if ok:
            out.append((name, p))
        else:
            rest += nbytes
    # NOTE: two Parameter objects over one storage would be mapped twice; keep the first
    by_ptr: dict[int, str] = {}
    uniq = []
    for name, p in out:
        ptr = p.data_ptr()
        if ptr in by_ptr:
            rest += p.numel() * p.element_size()
            continue
        by_ptr[ptr] = name
        uniq.append((name, p))
    return uniq, rest


def _layout(tensors: list[tuple[str, torch.Tensor]], key: str) -> tuple[bytes, list[dict], int]:
    entries, off = [], 0
    for name, t in tensors:
        entries.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                        "nbytes": t.numel() * t.element_size()})
    # header size depends on offsets; offsets on header size: iterate to a fixed point (2 passes)
    data0 = ALIGN
    for _ in range(4):
        off = data0
        for e in entries:
            e["offset"] = off
            off = (off + e["nbytes"] + ALIGN - 1) // ALIGN * ALIGN
        header = json.dumps({"version": LAYOUT_VERSION, "key": key, "tensors": entries}).encode()
        need = (len(MAGIC) + 8 + len(header) + ALIGN - 1) // ALIGN * ALIGN
        if need == data0:
            break
        data0 = need
    return header, entries, off


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _write(path: str, header: bytes, entries: list[dict], total: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write the cache file atomically: a temporary file in the same directory, fsync, rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _U64.pack(len(header)) + header)
            for e, (_, t) in zip(entries, tensors):
                f.seek(e["offset"])
                f.write(memoryview(_as_bytes(t).numpy()))
            f.truncate(total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_mapped(path: str, key: str, entries: list[dict], total: int):
    """The file's mmap (private, copy-on-write) if its header names exactly ``entries`` under ``key``,
    else None (missing, short, another layout, corrupt header)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != total:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    try:
        if mm[:len(MAGIC)] != MAGIC:
            raise ValueError("magic")
        n = _U64.unpack_from(mm, len(MAGIC))[0]
        head = json.loads(bytes(mm[len(MAGIC) + 8:len(MAGIC) + 8 + n]))
        if head.get("version") != LAYOUT_VERSION or head.get("key") != key or head.get("tensors") != entries:
            raise ValueError("header")
    except (ValueError, struct.error, UnicodeDecodeError):
        mm.close()
        return None
    return mm


def _views(mm, entries: list[dict]) -> list[torch.Tensor]:
    import numpy as np

    out = []
    for e in entries:
        raw = np.frombuffer(mm, dtype=np.uint8, count=e["nbytes"], offset=e["offset"])
        out.append(torch.from_numpy(raw).view(_DTYPES[e["dtype"]]).reshape(e["shape"]))
    return out


def prune_cache(directory: str, limit: int, keep: Optional[str] = None) -> int:
    """Delete the least recently used ``.pwm`` files (by mtime; a hit touches its file) until the rest
    total at most ``limit`` bytes, never ``keep``; also temporary files over an hour old (a crashed
    writer's). Returns the bytes of ``.pwm`` files left."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    files = []
    now = time.time()
    for n in names:
        p = os.path.join(directory, n)
        try:
            st = os.stat(p)
        except OSError:
            continue
        if ".pwm.tmp." in n:
            if now - st.st_mtime > 3600:
                _unlink(p)
            continue
        if n.endswith(SUFFIX):
            files.append((st.st_mtime, st.st_size, p))
    total = sum(s for _, s, _ in files)
    for _, size, p in sorted(files):
        if total <= limit:
            break
        if keep is not None and os.path.abspath(p) == os.path.abspath(keep):
            continue
        if _unlink(p):
            total -= size
    return total


def _unlink(p: str) -> bool:
    try:
        os.unlink(p)
        return True
    except OSError:
        return False


def map_model_weights(model: nn.Module, files: list[str], options: dict,
                      min_bytes: int = MIN_TENSOR_BYTES) -> MappedWeights:
    """Serve ``model``'s loaded parameters from a mapped cache file (module docstring).

    Every CPU, contiguous parameter of at least ``min_bytes`` gets its storage replaced (``p.data =``)
    by a view of the mapping, so every holder of the Parameter object sees it; the anonymous copies are
    freed (the caller hands the freed memory back to the OS). A tied weight is mapped once.

    Args:
        model: the loaded, processed model (after quantization methods and packing).
        files: the checkpoint files the weights came from (their path, size and mtime key the cache).
        options: load options that change the loaded tensors (dtype, quantization, ...).
        min_bytes: smaller parameters stay copies.

    Returns:
        a ``MappedWeights`` (hold it for as long as the model lives: it owns the mapping).
        Never raises for cache trouble (unwritable directory, full disk, corrupt file): the
        weights then stay copies and ``status`` says why.
    """
    res = MappedWeights()
    if not mmap_enabled():
        return res
    tensors, rest = _candidates(model, min_bytes)
    res.copied_bytes = rest
    if not tensors:
        res.status = "skipped: no parameter to map"
        return res
    try:
        limit = cache_limit_bytes()
        key = cache_key(files, options)
    except (OSError, ValueError) as e:
        res.status = f"skipped: {e}"
        return res
    header, entries, total = _layout(tensors, key)
    directory = cache_dir()
    path = os.path.join(directory, key + SUFFIX)
    if total > limit:
        res.status = f"skipped: {total} bytes exceed PAGEDLLM_WEIGHT_CACHE_MAX={limit}"
        res.copied_bytes += sum(e["nbytes"] for e in entries)
        return res
    mm = _open_mapped(path, key, entries, total)
    views = None
    if mm is not None:
        views = _views(mm, entries)
        if all(torch.equal(_as_bytes(v), _as_bytes(t)) for v, (_, t) in zip(views, tensors)):
            res.status = "hit"
            try:
                os.utime(path)
            except OSError:
                pass
        else:
            views = None
            res.status = "rebuilt"
    existed = os.path.exists(path)
    if views is None:
        # NOTE: drop our view of a stale file first: the rename below replaces its name, not its pages
        mm = None
        try:
            os.makedirs(directory, exist_ok=True)
            _write(path, header, entries, total, tensors)
        except OSError as e:
            res.status = f"skipped: cannot write {path}: {e}"
            res.copied_bytes += sum(e["nbytes"] for e in entries)
            return res
        if res.status != "rebuilt":
            res.status = "rebuilt" if existed else "written"
        mm = _open_mapped(path, key, entries, total)
        if mm is None:
            res.status = f"skipped: {path} unreadable after writing"
            res.copied_bytes += sum(e["nbytes"] for e in entries)
            return res
        views = _views(mm, entries)
    with torch.no_grad():
        for v, (_, t) in zip(views, tensors):
            t.data = v
    res.path, res._mm = path, [mm]
    res.mapped_bytes = sum(e["nbytes"] for e in entries)
    res.cache_bytes = prune_cache(directory, limit, keep=path)
    return res
