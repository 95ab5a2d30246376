"""Storage tiers for offloaded KV blocks: host memory (LRU, byte-bounded) and a disk directory
(byte-bounded, atomic checksummed files). Both store one block per key (its block hash).

A block is a CPU tensor ``KVCacheLayout.block_shape`` of the cache dtype.

Disk file format (one block per file, ``<dir>/<fingerprint[:16]>/<key[:2]>/<key>.kvblk``):

    b"PGLKVBLK"  (8 bytes magic)
    u32 little-endian header length H
    H bytes of JSON: {"version", "fingerprint", "key", "shape", "dtype", "payload_bytes"}
    payload_bytes bytes: the tensor's bytes (C order)
    u32 little-endian CRC-32 (zlib) of everything before it

Files are written to a temporary name in the same directory and renamed into place
(``os.replace``, atomic on POSIX), so a reader sees a whole file or none; the name is the content
address, so two processes writing the same block write the same bytes and either rename wins.
A file that is short, has a bad magic/CRC, another fingerprint, key or shape is ignored with a
warning and never loaded.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any, Optional

import torch

from pagedllm.distributed.kv_transfer.base import KVCacheLayout

logger = logging.getLogger("pagedllm")

MAGIC = b"PGLKVBLK"
FILE_VERSION = 1
SUFFIX = ".kvblk"


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TierStats:
    """Counters of one tier (blocks and bytes; monotonic totals)."""

    __slots__ = ("hits", "loads", "load_bytes", "saves", "save_bytes", "evictions", "errors", "dropped")

    def __init__(self) -> None:
        for s in self.__slots__:
            setattr(self, s, 0)

    def as_dict(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in self.__slots__}


class HostTier:
    """Blocks in host memory, least recently used evicted first, at most ``capacity_bytes``.

    Args:
        capacity_bytes: the bound (a block larger than it is not stored).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._blocks: "OrderedDict[bytes, torch.Tensor]" = OrderedDict()
        self.used_bytes = 0
        self.stats = TierStats()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> Optional[torch.Tensor]:
        """The block (marked most recently used), or None."""
        t = self._blocks.get(key)
        if t is not None:
            self._blocks.move_to_end(key)
        return t

    def touch(self, key: bytes) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def put(self, key: bytes, block: torch.Tensor) -> list[bytes]:
        """Store ``block`` under ``key`` (most recently used), evicting LRU blocks to fit.

        Returns the evicted keys. A block larger than the whole bound is not stored.
        """
        n = tensor_nbytes(block)
        if n > self.capacity_bytes:
            self.stats.dropped += 1
            return []
        old = self._blocks.pop(key, None)
        if old is not None:
            self.used_bytes -= tensor_nbytes(old)
        evicted = []
        while self.used_bytes + n > self.capacity_bytes and self._blocks:
            k, t = self._blocks.popitem(last=False)
            self.used_bytes -= tensor_nbytes(t)
            evicted.append(k)
        self._blocks[key] = block
        self.used_bytes += n
        self.stats.saves += 1
        self.stats.save_bytes += n
        self.stats.evictions += len(evicted)
        return evicted


def encode_block(layout: KVCacheLayout, key: bytes, block: torch.Tensor) -> tuple[bytes, memoryview, bytes]:
    """``(head, payload, trailer)``: the file's bytes in three pieces (see the module docstring)."""
    payload = memoryview(block.contiguous().view(torch.uint8).numpy()).cast("B")
    header = json.dumps({"version": FILE_VERSION, "fingerprint": layout.fingerprint, "key": key.hex(),
                         "shape": list(block.shape), "dtype": layout.dtype,
                         "payload_bytes": len(payload)}, sort_keys=True).encode()
    head = MAGIC + struct.pack("<I", len(header)) + header
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head, payload, struct.pack("<I", crc)


class BlockFileError(ValueError):
    """A stored block file that must not be loaded (the message says why)."""


def decode_block(layout: KVCacheLayout, key: bytes, data: bytes) -> torch.Tensor:
    """The block in ``data`` (a whole file), checked against ``layout`` and ``key``.

    Raises:
        BlockFileError: truncated, bad magic or CRC, another version/fingerprint/key/shape/dtype.
    """
    if len(data) < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
        raise BlockFileError("not a pagedllm KV block file (bad magic or too short)")
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    off = len(MAGIC) + 4
    if off + hlen + 4 > len(data):
        raise BlockFileError("truncated (header)")
    try:
        header = json.loads(data[off:off + hlen])
    except ValueError:
        raise BlockFileError("unreadable header") from None
    n = header.get("payload_bytes")
    if not isinstance(n, int) or off + hlen + n + 4 != len(data):
        raise BlockFileError(f"truncated or padded ({len(data)} bytes, header says payload {n})")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(memoryview(data)[:-4]) != crc:
        raise BlockFileError("checksum mismatch (torn or corrupted file)")
    if header.get("version") != FILE_VERSION:
        raise BlockFileError(f"file version {header.get('version')!r}, expected {FILE_VERSION}")
    if header.get("fingerprint") != layout.fingerprint:
        raise BlockFileError("written for another model or KV layout (fingerprint differs)")
    if header.get("key") != key.hex():
        raise BlockFileError("holds another block (key differs)")
    if tuple(header.get("shape") or ()) != layout.block_shape or header.get("dtype") != layout.dtype:
        raise BlockFileError(f"shape {header.get('shape')} / dtype {header.get('dtype')} differ from "
                             f"{list(layout.block_shape)} / {layout.dtype}")
    dtype = getattr(torch, layout.dtype)
    buf = bytearray(memoryview(data)[off + hlen:off + hlen + n])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(layout.block_shape)


class DiskTier:
    """Blocks as files under ``root`` (see the module docstring), at most ``capacity_bytes`` of
    them as this process counts (an index of the files it has seen, least recently used first;
    built from the directory at start-up). Writes go through a background thread so a step never
    waits for the disk; a failed write (full disk, I/O error) is dropped with a warning.

    Two processes may share ``root``: names are content addresses and files appear by atomic
    rename, so a reader sees a complete file or none; each process's bound counts the files it
    indexed (those present at its start-up, those it wrote, those it found on a lookup).

    Args:
        root: the directory (created if missing).
        layout: the KV layout; files of other layouts/models live in other subdirectories and,
            if found under this one's names, are refused by their header.
        capacity_bytes: the bound.
        fsync: fsync each file before its rename (crash-proof rather than checksum-detected).
        max_queued_bytes: writes waiting for the writer thread beyond this are dropped (counted).
    """

    def __init__(self, root: str, layout: KVCacheLayout, capacity_bytes: int, fsync: bool = False,
                 max_queued_bytes: int = 512 * 1024**2) -> None:
        self.layout = layout
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self.dir = os.path.join(os.path.abspath(root), layout.fingerprint[:16])
        os.makedirs(self.dir, exist_ok=True)
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: "OrderedDict[bytes, int]" = OrderedDict()  # key -> file bytes
        self.used_bytes = 0
        self._bad: set[bytes] = set()
        self._warned = 0
        self._scan()
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._queued: set[bytes] = set()
        self._queue: "queue.Queue[Optional[tuple[bytes, torch.Tensor]]]" = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-disk-writer", daemon=True)
        self._closed = False
        self._writer.start()
        # NOTE: the writer is a daemon thread: finish queued writes at interpreter exit too.
        import atexit
        import weakref
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda t: t.close(10) if t is not None else None)(ref()))

    # ---- paths and index -----------------------------------------------------------
    def path_of(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + SUFFIX)

    def _scan(self) -> None:
        """Index the block files already in the directory, oldest (mtime) first; stray temporary
        files of a killed writer are removed when older than a minute."""
        found = []
        now = time.time()
        for sub in os.listdir(self.dir):
            d = os.path.join(self.dir, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                p = os.path.join(d, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                if name.endswith(".tmp"):
                    if now - st.st_mtime > 60:
                        _unlink(p)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[:-len(SUFFIX)])
                except ValueError:
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._evict_over_bound()

    def __contains__(self, key: bytes) -> bool:
        """Indexed, or (another process wrote it) present on disk now."""
        with self._lock:
            if key in self._index or key in self._queued:
                return True
            if key in self._bad:
                return False
        try:
            size = os.stat(self.path_of(key)).st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self.used_bytes += size
        return True

    def __len__(self) -> int:
        return len(self._index)

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def _evict_over_bound(self) -> None:
        """Delete least recently used files until the index fits the bound (lock held or init)."""
        while self.used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            _unlink(self.path_of(key))
            self.stats.evictions += 1

    def _warn(self, msg: str, *a: Any) -> None:
        # NOTE: rate-limited: a broken disk must not flood the log (every event is counted).
        self._warned += 1
        if self._warned <= 20 or self._warned % 1000 == 0:
            logger.warning("pagedllm: KV disk tier: " + msg, *a)

    def _reject(self, key: bytes, msg: str, *a: Any) -> None:
        """A block file that cannot be used: count and warn (``msg % a``), drop it from the index
        and never read it again."""
        self.stats.errors += 1
        self._warn(msg, *a)
        with self._lock:
            self._forget(key)
            self._bad.add(key)

    # ---- reads -----------------------------------------------------------------------
    def get(self, key: bytes) -> Optional[torch.Tensor]:
        """Read and check the block; None (with a warning, counted in ``errors``) when the file
        is missing, unreadable or fails a check. A bad file is never loaded."""
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        except OSError as e:
            self._reject(key, "cannot read %s (%s); recomputing that block", path, e)
            return None
        try:
            block = decode_block(self.layout, key, data)
        except BlockFileError as e:
            self._reject(key, "ignoring %s: %s; recomputing that block", path, e)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return block

    # ---- writes ----------------------------------------------------------------------
    def put(self, key: bytes, block: torch.Tensor, overwrite: bool = False) -> bool:
        """Queue ``block`` for writing (the tensor must not change afterwards); False when it is
        already stored (unless ``overwrite``: its file may be bad) or queued, or the queue is over
        ``max_queued_bytes`` (dropped, counted)."""
        n = tensor_nbytes(block)
        with self._lock:
            if self._closed or key in self._queued or (key in self._index and not overwrite):
                return False
            if self._queued_bytes + n > self.max_queued_bytes:
                self.stats.dropped += 1
                return False
            self._queued.add(key)
            self._queued_bytes += n
        self._queue.put((key, block))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, block = item
            try:
                self.write_now(key, block)
            except Exception:  # never let the writer die
                logger.exception("pagedllm: KV disk tier writer failed")
            finally:
                with self._lock:
                    self._queued.discard(key)
                    self._queued_bytes -= tensor_nbytes(block)
                self._queue.task_done()

    def _open_tmp(self, path: str):
        """A new temporary file next to ``path`` (its own name: concurrent writers never share)."""
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        return tmp, open(tmp, "wb")

    def write_now(self, key: bytes, block: torch.Tensor) -> bool:
        """Write one file synchronously (tmp + rename); True on success. Errors are warned and
        counted, and leave no temporary file behind."""
        path = self.path_of(key)
        head, payload, trailer = encode_block(self.layout, key, block)
        size = len(head) + len(payload) + len(trailer)
        if size > self.capacity_bytes:
            self.stats.dropped += 1
            return False
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp, f = self._open_tmp(path)
            with f:
                f.write(head)
                f.write(payload)
                f.write(trailer)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            self.stats.errors += 1
            what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "write failed"
            self._warn("%s writing %s (%s); the block stays uncached on disk", what, path, e)
            return False
        finally:
            if tmp is not None:
                _unlink(tmp)
        with self._lock:
            self._bad.discard(key)
            self._forget(key)
            self._index[key] = size
            self.used_bytes += size
            self.stats.saves += 1
            self.stats.save_bytes += size
            self._evict_over_bound()
        return True

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until queued writes are done (True) or ``timeout`` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queued:
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued writes (up to ``timeout`` s) and stop the writer thread; idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=5)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
