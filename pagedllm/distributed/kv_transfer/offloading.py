"""``OffloadingConnector``: the prefix cache spills to host memory and a disk directory.

Scheduler side (engine-core process):

* **save**: when a request finishes, its full computed blocks whose hash no tier holds are
  queued; the next step's metadata asks the worker to copy them out of the KV cache (before that
  step's forward can overwrite a freed block), and ``update_connector_output`` stores the copies
  in the host tier (LRU, ``cpu_bytes_to_use``) and, with a ``kv_cache_dir``, queues them for the
  disk tier (written by a background thread; inclusive: the disk holds what the host holds and
  what the host evicted, up to its own bound).
* **load**: ``get_num_new_matched_tokens`` walks the request's block hashes past the device
  prefix hit: a block in the host tier, else a disk file that reads back whole and checks out, is
  a hit (disk hits are promoted to the host tier); the first miss ends the run. Those blocks are
  read *here*, so a load that is promised can no longer fail; the worker copies them into the
  blocks the scheduler allocated, before the step's forward.

Worker side: ``start_load_kv`` does the step's saves (gather from the caches) then its loads
(scatter into them); both are plain CPU copies, done before the forward. Blocks move as tensors
inside the metadata / connector output, which costs nothing with the in-process executor
(``distributed_executor_backend="uni"``, the only one this connector supports).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedllm.distributed.kv_transfer.base import (KVCacheLayout, KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorRole)
from pagedllm.distributed.kv_transfer.tiers import DiskTier, HostTier

logger = logging.getLogger("pagedllm")

#: Host tier bound when the config names none (``--kv-offloading-size`` unset).
DEFAULT_CPU_BYTES = 4 * 1024**3


def model_fingerprint(args: Any, hf_config: Any, model_path: Optional[str], dtype: Any,
                      kv_cache_dtype: Any) -> str:
    """sha256 hex naming what determines the KV values a model computes: the model (its name,
    resolved path, weight files' names, sizes and mtimes), its config, revision, quantization,
    compute and KV dtypes, and the Python version (block hashes pickle token tuples).

    A new checkpoint at the same path (other sizes or mtimes) gets a new fingerprint, so its
    stored blocks are foreign."""
    files = []
    if model_path and os.path.exists(model_path):
        paths = [model_path] if os.path.isfile(model_path) else [
            os.path.join(model_path, n) for n in sorted(os.listdir(model_path))]
        for p in paths:
            try:
                st = os.stat(p)
            except OSError:
                continue
            if os.path.isfile(p):
                files.append((os.path.basename(p), st.st_size, st.st_mtime_ns))
    try:
        cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    except Exception:
        cfg = {}
    cfg = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
    d = {"model": str(args.model), "path": os.path.abspath(model_path) if model_path else None,
         "files": files, "config": cfg, "revision": getattr(args, "revision", None),
         "quantization": getattr(args, "quantization", None), "hf_overrides": repr(getattr(args, "hf_overrides", None)),
         "dtype": str(dtype), "kv_cache_dtype": str(kv_cache_dtype), "python": list(sys.version_info[:2])}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """One step's transfers.

    Attributes:
        saves: ``(key, block_id)``: copy block ``block_id`` of every layer out (before loads).
        loads: ``(block_id, block)``: copy ``block`` (``layout.block_shape``) into ``block_id``.
    """

    saves: list[tuple[bytes, int]] = field(default_factory=list)
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class OffloadingConnector(KVConnectorBase_V1):
    """Host-memory and disk tiers behind the prefix cache (see the module docstring).

    ``config.kv_role``: "kv_both" saves and loads; "kv_producer" only saves (an instance that
    fills a shared ``kv_cache_dir`` for others), "kv_consumer" only loads (one that reads it).

    ``config.kv_connector_extra_config``: ``cpu_bytes_to_use`` (host bound, bytes; default 4 GiB),
    ``kv_cache_dir`` (disk tier directory; none = no disk tier), ``disk_bytes_to_use`` (disk bound,
    bytes; default 16 GiB), ``fsync`` (bool).

    Raises:
        ValueError: a bound that is not a positive integer, a directory that cannot be created.
    """

    def __init__(self, config: Any, role: KVConnectorRole, layout: KVCacheLayout) -> None:
        super().__init__(config, role, layout)
        self.kv_caches: list[torch.Tensor] = []
        self._output: Optional[dict[bytes, torch.Tensor]] = None
        if role != KVConnectorRole.SCHEDULER:
            return
        from pagedllm.distributed.kv_transfer.config import DEFAULT_DISK_BYTES

        extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
        known = {"cpu_bytes_to_use", "kv_cache_dir", "disk_bytes_to_use", "fsync"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown} for "
                             f"OffloadingConnector; expected {sorted(known)}")
        cpu = _positive_int("cpu_bytes_to_use", extra.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES))
        self.host = HostTier(cpu)
        self.disk: Optional[DiskTier] = None
        d = extra.get("kv_cache_dir")
        if d:
            disk_bytes = _positive_int("disk_bytes_to_use", extra.get("disk_bytes_to_use", DEFAULT_DISK_BYTES))
            try:
                self.disk = DiskTier(str(d), layout, disk_bytes, fsync=bool(extra.get("fsync", False)))
            except OSError as e:
                raise ValueError(f"kv_cache_dir: cannot use {d!r}: {e}") from None
        self.block_bytes = 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * \
            torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
        # request id -> (first block index, blocks read for it) from get_num_new_matched_tokens.
        self._prepared: dict[str, tuple[int, list[torch.Tensor], list[str]]] = {}
        self._pending_saves: dict[bytes, int] = {}   # key -> block id, for the next step
        self._in_flight: set[bytes] = set()           # saves sent, output not back yet
        self._rewrite: set[bytes] = set()             # saves whose disk file is rewritten if present
        self._loads: list[tuple[int, torch.Tensor]] = []
        role_name = getattr(config, "kv_role", None) or "kv_both"
        self.saves_enabled = role_name in ("kv_both", "kv_producer")
        self.loads_enabled = role_name in ("kv_both", "kv_consumer")
        self.hit_tokens = 0
        self.load_seconds = 0.0
        logger.info("pagedllm: KV offloading: host tier %.2f GiB%s", cpu / 1024**3,
                    f", disk tier {self.disk.capacity_bytes / 1024**3:.2f} GiB at {self.disk.dir} "
                    f"({len(self.disk)} blocks found)" if self.disk else "")

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches.values())
        shape = self.layout.block_shape
        for name, t in kv_caches.items():
            if tuple(t.shape[1:]) != shape[1:]:
                raise ValueError(f"OffloadingConnector: cache {name} has block shape {tuple(t.shape[1:])}, "
                                 f"layout says {shape[1:]}")

    @torch.inference_mode()
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Saves (gather every layer's block into one tensor per block), then loads (scatter)."""
        meta = self._get_connector_metadata()
        self._output = None
        if not isinstance(meta, OffloadingMetadata) or not self.kv_caches:
            return
        if meta.saves:
            ids = torch.tensor([b for _, b in meta.saves], dtype=torch.long)
            gathered = torch.stack([c.index_select(0, ids) for c in self.kv_caches], dim=1)  # [n, L, 2, bs, H, D]
            self._output = {key: gathered[i].clone() for i, (key, _) in enumerate(meta.saves)}
        if meta.loads:
            ids = torch.tensor([b for b, _ in meta.loads], dtype=torch.long)
            blocks = torch.stack([t for _, t in meta.loads])  # [n, L, 2, bs, H, D]
            for layer, c in enumerate(self.kv_caches):
                c.index_copy_(0, ids, blocks[:, layer].to(c.dtype))

    def get_connector_output(self) -> Optional[dict[bytes, torch.Tensor]]:
        """The blocks saved this step: key -> ``layout.block_shape`` tensor."""
        out, self._output = self._output, None
        return out

    # ------------------------------------------------------------------ scheduler side
    def _lookup(self, key: bytes) -> tuple[Optional[torch.Tensor], str]:
        t = self.host.get(key)
        if t is not None:
            return t, "host"
        if self.disk is not None and key in self.disk:
            t = self.disk.get(key)
            if t is not None:
                self.host.put(key, t)  # promote
                return t, "disk"
        return None, ""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not self.loads_enabled:
            return 0, False
        bs = self.layout.block_size
        start = num_computed_tokens // bs
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.block_hashes
        prev = self._prepared.get(request.request_id)
        if prev is not None and prev[0] == start:
            return len(prev[1]) * bs, False
        t0 = time.perf_counter()
        blocks: list[torch.Tensor] = []
        tiers: list[str] = []
        for i in range(start, min(max_blocks, len(hashes))):
            t, tier = self._lookup(hashes[i])
            if t is None:
                break
            blocks.append(t)
            tiers.append(tier)
        self.load_seconds += time.perf_counter() - t0
        if not blocks:
            self._prepared.pop(request.request_id, None)
            return 0, False
        for tier in tiers:
            (self.host if tier == "host" else self.disk).stats.hits += 1
        self._prepared[request.request_id] = (start, blocks, tiers)
        return len(blocks) * bs, False

    def update_state_after_alloc(self, request: Any, blocks: list[Any], num_external_tokens: int) -> None:
        prep = self._prepared.pop(request.request_id, None)
        if prep is None or num_external_tokens <= 0:
            return
        _, tensors, tiers = prep
        n = num_external_tokens // self.layout.block_size
        assert n <= len(tensors) and len(blocks) == n, (n, len(tensors), len(blocks))
        for b, t, tier in zip(blocks, tensors, tiers):
            self._loads.append((b.block_id, t))
            st = (self.host if tier == "host" else self.disk).stats
            st.loads += 1
            st.load_bytes += self.block_bytes
        self.hit_tokens += num_external_tokens

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        self._prepared.pop(request.request_id, None)
        if not self.saves_enabled:
            return False, None
        bs = self.layout.block_size
        n = min(len(request.block_hashes), request.num_computed_tokens // bs, len(block_ids))
        # Blocks past the prefix found at admission were computed: a disk file under their name
        # (past the first miss, never read) may be bad, so it is rewritten.
        computed_from = max(request.num_cached_tokens, 0) // bs
        for i in range(n):
            key = request.block_hashes[i]
            if key in self._pending_saves or key in self._in_flight:
                continue
            if key in self.host:
                self.host.touch(key)
                continue
            self._pending_saves[key] = block_ids[i]
            if i >= computed_from:
                self._rewrite.add(key)
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingMetadata:
        meta = OffloadingMetadata(saves=list(self._pending_saves.items()), loads=self._loads)
        self._in_flight.update(self._pending_saves)
        self._pending_saves = {}
        self._loads = []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._in_flight.clear()
        rewrite, self._rewrite = self._rewrite, set()
        if not connector_output:
            return
        for key, block in connector_output.items():
            self.host.put(key, block)
            if self.disk is not None:
                self.disk.put(key, block, overwrite=key in rewrite)

    def has_pending_work(self) -> bool:
        return bool(self._pending_saves)

    def get_kv_connector_stats(self) -> dict:
        """``{"tiers": {"host"|"disk": {hits, loads, load_bytes, saves, save_bytes, evictions,
        errors, dropped, blocks, bytes, capacity_bytes}}, "hit_tokens", "load_seconds"}`` (blocks
        and bytes; totals except ``blocks``/``bytes``, which are held now)."""
        tiers = {"host": {**self.host.stats.as_dict(), "blocks": len(self.host), "bytes": self.host.used_bytes,
                          "capacity_bytes": self.host.capacity_bytes}}
        if self.disk is not None:
            tiers["disk"] = {**self.disk.stats.as_dict(), "blocks": len(self.disk), "bytes": self.disk.used_bytes,
                             "capacity_bytes": self.disk.capacity_bytes}
        return {"tiers": tiers, "hit_tokens": self.hit_tokens, "load_seconds": self.load_seconds}

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER and self.disk is not None:
            self.disk.close()


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) < 1:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name}: must be a positive number "
                         f"of bytes, got {v!r}")
    return int(v)
