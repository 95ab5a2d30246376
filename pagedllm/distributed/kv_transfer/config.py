"""``KVTransferConfig`` (vLLM's ``--kv-transfer-config``) and the offloading flags that build one
(pure Python, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.config import parse_json_arg

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
OFFLOADING_BACKENDS = ("native",)
GiB = 1024**3
#: Disk tier bound when ``--kv-cache-dir`` is given without ``--kv-cache-dir-size``.
DEFAULT_DISK_BYTES = 16 * GiB


@dataclass
class KVTransferConfig:
    """Which KV connector the engine runs and how (vLLM's ``KVTransferConfig`` fields).

    Attributes:
        kv_connector: registered connector name (``KVConnectorFactory``), e.g. "OffloadingConnector".
        kv_role: "kv_producer", "kv_consumer" or "kv_both" (vLLM's roles; the offloading connector
            is "kv_both": it saves and loads).
        kv_connector_extra_config: connector-specific settings. OffloadingConnector reads
            ``cpu_bytes_to_use`` (host tier bound, bytes), ``kv_cache_dir`` (disk tier directory),
            ``disk_bytes_to_use`` (disk tier bound, bytes), ``fsync`` (fsync each file before its
            rename; default False: the checksum catches a torn file instead).
        kv_connector_module_path: a module to import that registers ``kv_connector`` (a connector
            kept out of tree); None = built-in connectors only.
        kv_ip / kv_port: where a ``P2pConnector`` producer listens for its consumers (vLLM's
            fields and defaults: "127.0.0.1", 14579).
        engine_id: a name for this instance in ``kv_transfer_params`` (``remote_engine_id``);
            None = ``kv_ip:kv_port``.
    """

    kv_connector: Optional[str] = None
    kv_role: Optional[str] = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: Optional[str] = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: Optional[str] = None

    @classmethod
    def from_any(cls, value: Any) -> Optional["KVTransferConfig"]:
        """None, a ``KVTransferConfig``, a dict or a JSON object string -> a checked config.

        Raises:
            ValueError: invalid JSON, unknown keys, a missing ``kv_connector``, a bad ``kv_role``
                (the message names the field, prefixed ``kv_transfer_config``).
        """
        if value is None or isinstance(value, cls):
            cfg = value
        else:
            value = parse_json_arg(value, "kv_transfer_config")
            known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path",
                     "kv_ip", "kv_port", "engine_id"}
            # NOTE: vLLM's other fields (kv_buffer_device, kv_rank, kv_parallel_size, ...) only matter
            # to its GPU connectors; accepted and ignored.
            ignored = {"kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
                       "kv_load_failure_policy"}
            unknown = sorted(set(value) - known - ignored)
            if unknown:
                raise ValueError(f"kv_transfer_config: unknown field(s) {unknown}; expected {sorted(known)}")
            extra = value.get("kv_connector_extra_config") or {}
            if not isinstance(extra, dict):
                raise ValueError("kv_transfer_config.kv_connector_extra_config: expected a JSON object")
            cfg = cls(kv_connector=value.get("kv_connector"), kv_role=value.get("kv_role"),
                      kv_connector_extra_config=dict(extra),
                      kv_connector_module_path=value.get("kv_connector_module_path"))
            if value.get("kv_ip") is not None:
                if not isinstance(value["kv_ip"], str) or not value["kv_ip"]:
                    raise ValueError(f"kv_transfer_config.kv_ip: expected a host name, got {value['kv_ip']!r}")
                cfg.kv_ip = value["kv_ip"]
            if value.get("kv_port") is not None:
                port = value["kv_port"]
                if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                    raise ValueError(f"kv_transfer_config.kv_port: expected a port 1-65535, got {port!r}")
                cfg.kv_port = port
            if value.get("engine_id") is not None:
                cfg.engine_id = str(value["engine_id"])
        if cfg is None:
            return None
        if not cfg.kv_connector or not isinstance(cfg.kv_connector, str):
            raise ValueError("kv_transfer_config.kv_connector: required (a connector name such as "
                             "'OffloadingConnector')")
        if cfg.kv_role is None:
            cfg.kv_role = "kv_both"
        if cfg.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role: must be one of {list(KV_ROLES)}, got {cfg.kv_role!r}")
        return cfg

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def _positive_gib(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a size in GiB (a number), got {value!r}") from None
    if not v > 0:
        raise ValueError(f"{name}: must be > 0 GiB, got {value!r}")
    return v


def resolve_kv_transfer_config(kv_transfer_config: Any, kv_offloading_size: Optional[float] = None,
                               kv_offloading_backend: Optional[str] = None,
                               kv_cache_dir: Optional[str] = None,
                               kv_cache_dir_size: Optional[float] = None) -> Optional[KVTransferConfig]:
    """The engine's connector config from vLLM's flags.

    ``--kv-offloading-size GIB`` (vLLM) alone configures ``OffloadingConnector`` ("kv_both") with
    a host tier of that many GiB; ``--kv-cache-dir DIR`` (pagedllm) adds its disk tier, bounded by
    ``--kv-cache-dir-size GIB`` (default 16). With an explicit ``--kv-transfer-config`` naming
    ``OffloadingConnector``, these flags fill in the extra-config keys it leaves unset.

    Raises:
        ValueError: a bad size, an unknown backend, or the flags given with another connector.
    """
    cfg = KVTransferConfig.from_any(kv_transfer_config)
    if kv_offloading_backend is not None and kv_offloading_backend not in OFFLOADING_BACKENDS:
        raise ValueError(f"kv_offloading_backend: must be one of {list(OFFLOADING_BACKENDS)} "
                         f"(lmcache is not available here), got {kv_offloading_backend!r}")
    wants = kv_offloading_size is not None or kv_cache_dir is not None
    if not wants:
        if kv_cache_dir_size is not None:
            raise ValueError("kv_cache_dir_size: needs kv_cache_dir (--kv-cache-dir)")
        return cfg
    if cfg is None:
        cfg = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    elif cfg.kv_connector != "OffloadingConnector":
        raise ValueError(f"kv_offloading_size / kv_cache_dir: configure OffloadingConnector, but "
                         f"kv_transfer_config.kv_connector is {cfg.kv_connector!r}")
    extra = cfg.kv_connector_extra_config
    if kv_offloading_size is not None:
        extra.setdefault("cpu_bytes_to_use", int(_positive_gib("kv_offloading_size", kv_offloading_size) * GiB))
    if kv_cache_dir is not None:
        extra.setdefault("kv_cache_dir", str(kv_cache_dir))
        if kv_cache_dir_size is not None:
            extra.setdefault("disk_bytes_to_use", int(_positive_gib("kv_cache_dir_size", kv_cache_dir_size) * GiB))
    elif kv_cache_dir_size is not None:
        raise ValueError("kv_cache_dir_size: needs kv_cache_dir (--kv-cache-dir)")
    return cfg
