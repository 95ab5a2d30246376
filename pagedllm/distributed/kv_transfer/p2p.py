"""``P2pConnector``: prefill/decode disaggregation between two instances on one machine (TCP).

One instance prefills (``kv_role`` "kv_producer"), another decodes ("kv_consumer"); a proxy
(``pagedllm disagg-proxy``, ``pagedllm.entrypoints.disagg_proxy``) sends each request to the
prefiller with ``max_tokens=1`` and ``kv_transfer_params: {"do_remote_decode": true}``, then the
whole request to the decoder with the ``kv_transfer_params`` the prefiller's response carried
(vLLM's disaggregated-serving fields: ``do_remote_prefill``, ``remote_engine_id``,
``remote_host``, ``remote_port``, ``remote_request_id``). The decoder loads the prompt's KV blocks
from the prefiller and computes only the last, partial block, then decodes.

Producer (scheduler side, in the engine-core process):

* ``request_finished`` of a request with ``do_remote_decode`` (not aborted) registers a
  *transfer* under its request id: the prompt's full computed blocks, addressed by their block
  hashes. Blocks the staging buffer lacks are saved by the next step (the worker copies them out
  of the KV cache before anything can overwrite them); the request's device blocks are freed at
  once, so the KV pool never waits for a decoder.
* The staging buffer (host memory) is bounded by ``buffer_bytes_to_use``; past it the oldest
  transfers are dropped (counted). A transfer is freed when a consumer fetched it, when a consumer
  released it (its request was aborted first), or ``abort_request_timeout_s`` after it was staged
  (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``: a decoder that never came).
* A TCP server thread on ``kv_ip:kv_port`` answers ``get`` (the longest run of the asked hashes
  it holds, then the transfer is freed) and ``release``.

Consumer (scheduler side):

* ``get_num_new_matched_tokens`` of a request whose ``kv_transfer_params`` has
  ``do_remote_prefill`` starts a background fetch and returns None (vLLM's "not yet": the
  scheduler skips the request, keeping its place, so running requests keep decoding while the KV
  arrives). When the fetch is done it offers the fetched blocks past the device prefix hit; the
  worker copies them into the allocated blocks before the step's forward.
* A fetch that fails (refused, timed out, truncated, another model's layout) is a warning and a
  count; the request computes its prompt itself (recompute), so a failed transfer never changes a
  token. A request aborted before its fetch sends ``release`` to the producer.

Wire format (one TCP connection per message): a 4-byte big-endian length and a JSON header, then
for ``get`` replies a payload of ``n`` blocks, each ``layout.block_shape`` in the KV dtype,
C-contiguous. The header carries the producer's ``KVCacheLayout.fingerprint``; a consumer whose
fingerprint differs rejects the blocks. A NIXL/RDMA transport would replace ``_serve``/``_fetch``
(the same addresses, the same lifecycle) and register the KV caches with its agent.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedllm.distributed.kv_transfer.base import KVCacheLayout, KVConnectorRole
from pagedllm.distributed.kv_transfer.offloading import OffloadingConnector, OffloadingMetadata
from pagedllm.distributed.kv_transfer.tiers import TierStats

logger = logging.getLogger("pagedllm")

#: Staging buffer bound when the config names none (bytes).
DEFAULT_BUFFER_BYTES = 1024**3
#: Seconds a staged transfer waits for its decoder (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
DEFAULT_ABORT_TIMEOUT_S = 480.0
#: Consumer socket timeout per fetch (connect and each read), seconds.
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
#: How long a producer's ``get`` waits for a transfer whose saves have not run yet, seconds.
_READY_WAIT_S = 5.0
_MAX_HEADER = 1 << 24

_EXTRA_KEYS = {"buffer_bytes_to_use", "abort_request_timeout_s", "transfer_timeout_s"}


def kv_transfer_params_of(request: Any) -> Optional[dict]:
    """The request's ``kv_transfer_params`` (``SamplingParams.extra_args["kv_transfer_params"]``,
    where the OpenAI server puts the request field, as vLLM does), or None."""
    sp = getattr(request, "sampling_params", None)
    extra = getattr(sp, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    p = extra.get("kv_transfer_params")
    return p if isinstance(p, dict) else None


def prefill_response_params(kv_transfer_config: Any, request_kv_params: Optional[dict],
                            engine_request_id: str) -> Optional[dict]:
    """The ``kv_transfer_params`` a prefill response carries for the decoder (vLLM's fields), or
    None when the request did not ask for a remote decode or this server is no P2P producer.

    Args:
        kv_transfer_config: the server's ``kv_transfer_config`` (any form ``KVTransferConfig.from_any``
            takes; None = no connector).
        request_kv_params: the request's ``kv_transfer_params`` field.
        engine_request_id: the engine request id the producer staged the blocks under.
    """
    if not isinstance(request_kv_params, dict) or not request_kv_params.get("do_remote_decode"):
        return None
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig

    try:
        cfg = KVTransferConfig.from_any(kv_transfer_config)
    except ValueError:
        return None
    if cfg is None or cfg.kv_connector != "P2pConnector" or not cfg.is_kv_producer:
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": cfg.engine_id or f"{cfg.kv_ip}:{cfg.kv_port}",
            "remote_host": cfg.kv_ip, "remote_port": cfg.kv_port, "remote_request_id": engine_request_id,
            "remote_block_ids": None}


# ---------------------------------------------------------------------------- wire helpers
def _send_msg(sock: socket.socket, header: dict, payload: Optional[memoryview] = None) -> None:
    h = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(h)) + h)
    if payload is not None and len(payload):
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _recv_header(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", bytes(_recv_exact(sock, 4)))
    if n > _MAX_HEADER:
        raise ConnectionError(f"header of {n} bytes")
    h = json.loads(bytes(_recv_exact(sock, n)))
    if not isinstance(h, dict):
        raise ConnectionError("header is not a JSON object")
    return h


# ---------------------------------------------------------------------------- producer staging
@dataclass
class _Transfer:
    keys: list[bytes]
    deadline: float
    unsaved: set[bytes] = field(default_factory=set)


class _Staging:
    """The producer's staged blocks: transfers (request id -> block keys) over a refcounted,
    byte-bounded block map. Thread-safe (engine thread + server threads)."""

    def __init__(self, capacity_bytes: int, block_bytes: int, timeout_s: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.transfers: "OrderedDict[str, _Transfer]" = OrderedDict()
        self.tensors: dict[bytes, torch.Tensor] = {}
        self.refs: dict[bytes, int] = {}
        self.stats = TierStats()
        self.events = {"staged": 0, "sent": 0, "released": 0, "expired": 0, "evicted": 0}

    @property
    def used_bytes(self) -> int:
        return len(self.refs) * self.block_bytes

    def _drop(self, rid: str, event: str) -> None:
        t = self.transfers.pop(rid, None)
        if t is None:
            return
        self.events[event] += 1
        for k in t.keys:
            r = self.refs.get(k, 0) - 1
            if r <= 0:
                self.refs.pop(k, None)
                self.tensors.pop(k, None)
                if event in ("expired", "evicted"):
                    self.stats.evictions += 1
            else:
                self.refs[k] = r
        self.cond.notify_all()

    def stage(self, rid: str, keys: list[bytes]) -> list[bytes]:
        """Register transfer ``rid`` of ``keys``; returns the keys that must be saved."""
        with self.cond:
            self._drop(rid, "released")  # a reused id: the old one is stale
            new = [k for k in dict.fromkeys(keys) if k not in self.refs]
            need = len(new) * self.block_bytes
            while self.transfers and self.used_bytes + need > self.capacity_bytes:
                self._drop(next(iter(self.transfers)), "evicted")
                new = [k for k in dict.fromkeys(keys) if k not in self.refs]
                need = len(new) * self.block_bytes
            room = max(0, (self.capacity_bytes - self.used_bytes) // self.block_bytes)
            if len(new) > room:  # keep the longest prefix that fits
                cut = set(new[room:])
                i = next(i for i, k in enumerate(keys) if k in cut)
                self.stats.dropped += len(keys) - i
                keys = keys[:i]
                new = new[:room]
            if not keys:
                return []
            for k in keys:
                self.refs[k] = self.refs.get(k, 0) + 1
            self.transfers[rid] = _Transfer(keys, time.monotonic() + self.timeout_s, set(new))
            self.events["staged"] += 1
            return new

    def saved(self, blocks: dict[bytes, torch.Tensor]) -> None:
        with self.cond:
            for k, t in blocks.items():
                if k in self.refs and k not in self.tensors:
                    self.tensors[k] = t
                    self.stats.saves += 1
                    self.stats.save_bytes += self.block_bytes
            for t in self.transfers.values():
                t.unsaved.difference_update(blocks)
            self.cond.notify_all()

    def expire(self) -> None:
        now = time.monotonic()
        with self.cond:
            for rid in [r for r, t in self.transfers.items() if t.deadline <= now]:
                self._drop(rid, "expired")

    def take(self, rid: Optional[str], keys: list[bytes], wait_s: float) -> list[torch.Tensor]:
        """The longest run of ``keys`` held (waiting up to ``wait_s`` for transfer ``rid``'s saves),
        then transfer ``rid`` is freed."""
        end = time.monotonic() + wait_s
        with self.cond:
            while rid in self.transfers and self.transfers[rid].unsaved:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            out = []
            for k in keys:
                t = self.tensors.get(k)
                if t is None:
                    break
                out.append(t)
            if out:
                self.stats.hits += len(out)
                self.stats.loads += len(out)
                self.stats.load_bytes += len(out) * self.block_bytes
            if rid in self.transfers:
                self._drop(rid, "sent")
            return out

    def release(self, rid: str) -> None:
        with self.cond:
            self._drop(rid, "released")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


# ---------------------------------------------------------------------------- consumer fetches
class _Fetch:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.blocks: Optional[torch.Tensor] = None  # [k, *block_shape] on success
        self.start = 0                              # first block offered (set at offer time)


class P2pConnector(OffloadingConnector):
    """Prefill/decode disaggregation over TCP on one machine (see the module docstring).

    ``config.kv_role``: "kv_producer" (prefiller: stages and serves), "kv_consumer" (decoder:
    fetches), "kv_both" (both). ``config.kv_ip`` / ``config.kv_port``: where a producer listens
    (vLLM's fields; defaults 127.0.0.1:14579). ``config.kv_connector_extra_config``:
    ``buffer_bytes_to_use`` (producer staging bound, bytes; default 1 GiB),
    ``abort_request_timeout_s`` (a staged transfer nobody fetched is freed after it; default 480),
    ``transfer_timeout_s`` (consumer socket timeout; default 10).

    Raises:
        ValueError: a bad extra-config value, or a producer that cannot listen on kv_ip:kv_port.
    """

    #: ``get_kv_connector_stats`` may be called from any thread (/metrics reads it live).
    stats_thread_safe = True

    def __init__(self, config: Any, role: KVConnectorRole, layout: KVCacheLayout) -> None:
        from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1

        KVConnectorBase_V1.__init__(self, config, role, layout)
        self.kv_caches: list[torch.Tensor] = []
        self._output: Optional[dict[bytes, torch.Tensor]] = None
        if role != KVConnectorRole.SCHEDULER:
            return
        extra = dict(getattr(config, "kv_connector_extra_config", None) or {})
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown} for "
                             f"P2pConnector; expected {sorted(_EXTRA_KEYS)}")
        self.block_bytes = 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * \
            torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
        self.fingerprint = layout.fingerprint
        self.is_producer = bool(config.is_kv_producer)
        self.is_consumer = bool(config.is_kv_consumer)
        self.transfer_timeout_s = _positive_float("transfer_timeout_s",
                                                  extra.get("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))
        self._pending_saves: dict[bytes, int] = {}
        self._loads: list[tuple[int, torch.Tensor]] = []
        self.hit_tokens = 0
        self.load_seconds = 0.0
        # consumer
        self._fetches: dict[str, _Fetch] = {}
        self._done: set[str] = set()
        self.recv = TierStats()
        self.recv_events = {"received": 0, "failed": 0, "released": 0}
        self._warned_at = 0.0
        self._lock = threading.Lock()
        # producer
        self.staging: Optional[_Staging] = None
        self._server: Optional[_Server] = None
        self._stop = threading.Event()
        if self.is_producer:
            cap = extra.get("buffer_bytes_to_use", DEFAULT_BUFFER_BYTES)
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or int(cap) < 1:
                raise ValueError("kv_transfer_config.kv_connector_extra_config.buffer_bytes_to_use: must be a "
                                 f"positive number of bytes, got {cap!r}")
            timeout = _positive_float("abort_request_timeout_s",
                                      extra.get("abort_request_timeout_s", DEFAULT_ABORT_TIMEOUT_S))
            self.staging = _Staging(int(cap), self.block_bytes, timeout)
            self._start_server(config.kv_ip, int(config.kv_port))
            logger.info("pagedllm: P2pConnector producer on %s:%d (staging %.2f GiB, abort timeout %.0f s)",
                        config.kv_ip, config.kv_port, int(cap) / 1024**3, timeout)
        if self.is_consumer:
            logger.info("pagedllm: P2pConnector consumer (transfer timeout %.1f s)", self.transfer_timeout_s)

    # ------------------------------------------------------------------ producer
    def _start_server(self, host: str, port: int) -> None:
        staging = self.staging
        assert staging is not None
        conn = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    self.request.settimeout(conn.transfer_timeout_s)
                    conn._serve(self.request)
                except Exception as e:  # a broken client must not kill the server
                    logger.debug("pagedllm: P2pConnector: request from %s failed: %s", self.client_address, e)

        try:
            self._server = _Server((host, port), Handler)
        except OSError as e:
            raise ValueError(f"kv_transfer_config.kv_port: cannot listen on {host}:{port}: {e}") from None
        threading.Thread(target=self._server.serve_forever, name="pagedllm-p2p-kv-server", daemon=True).start()

        def reaper() -> None:
            while not self._stop.wait(min(1.0, staging.timeout_s / 4)):
                staging.expire()

        threading.Thread(target=reaper, name="pagedllm-p2p-kv-reaper", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        staging = self.staging
        assert staging is not None
        h = _recv_header(sock)
        op = h.get("op")
        rid = h.get("request_id")
        rid = str(rid) if rid is not None else None
        if op == "release" and rid is not None:
            staging.release(rid)
            _send_msg(sock, {"ok": True})
            return
        if op != "get":
            _send_msg(sock, {"ok": False, "error": f"unknown op {op!r}"})
            return
        keys = [bytes.fromhex(k) for k in h.get("keys", [])]
        if h.get("fingerprint") != self.fingerprint:
            staging.release(rid) if rid is not None else None
            _send_msg(sock, {"ok": False, "error": "layout fingerprint differs (another model or KV layout)"})
            return
        blocks = staging.take(rid, keys, _READY_WAIT_S)
        payload = torch.stack(blocks).contiguous() if blocks else None
        _send_msg(sock, {"ok": True, "n": len(blocks), "fingerprint": self.fingerprint,
                         "shape": list(self.layout.block_shape), "dtype": self.layout.dtype},
                  memoryview(payload.view(torch.uint8).numpy()).cast("B") if payload is not None else None)

    # ------------------------------------------------------------------ consumer
    def _warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned_at > 5.0:
            self._warned_at = now
            logger.warning("pagedllm: P2pConnector: " + msg + " (the prompt is recomputed)", *args)

    def _fetch(self, f: _Fetch, params: dict, keys: list[bytes]) -> None:
        t0 = time.perf_counter()
        try:
            host, port = params.get("remote_host"), params.get("remote_port")
            if not host or not isinstance(port, int):
                raise ValueError(f"kv_transfer_params: no remote_host/remote_port ({host!r}, {port!r})")
            with socket.create_connection((host, port), timeout=self.transfer_timeout_s) as sock:
                _send_msg(sock, {"op": "get", "request_id": params.get("remote_request_id"),
                                 "keys": [k.hex() for k in keys], "fingerprint": self.fingerprint})
                h = _recv_header(sock)
                if not h.get("ok"):
                    raise ValueError(f"producer refused: {h.get('error')}")
                n = int(h.get("n", 0))
                if h.get("fingerprint") != self.fingerprint or tuple(h.get("shape", ())) != self.layout.block_shape \
                        or h.get("dtype") != self.layout.dtype or not 0 <= n <= len(keys):
                    raise ValueError("producer's blocks have another layout")
                if n:
                    buf = _recv_exact(sock, n * self.block_bytes)
                    dtype = getattr(torch, self.layout.dtype)
                    f.blocks = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(n, *self.layout.block_shape)
                else:
                    f.blocks = torch.empty((0, *self.layout.block_shape), dtype=getattr(torch, self.layout.dtype))
            with self._lock:
                self.recv_events["received"] += 1
                self.recv.hits += n
                self.load_seconds += time.perf_counter() - t0
        except Exception as e:
            f.blocks = None
            with self._lock:
                self.recv_events["failed"] += 1
                self.recv.errors += 1
            self._warn("KV transfer from %s:%s failed: %s", params.get("remote_host"), params.get("remote_port"), e)
        finally:
            f.done.set()

    def _release_remote(self, params: dict) -> None:
        def run() -> None:
            try:
                with socket.create_connection((params["remote_host"], params["remote_port"]),
                                              timeout=self.transfer_timeout_s) as sock:
                    _send_msg(sock, {"op": "release", "request_id": params.get("remote_request_id")})
                    _recv_header(sock)
                with self._lock:
                    self.recv_events["released"] += 1
            except Exception as e:
                logger.debug("pagedllm: P2pConnector: release failed: %s", e)

        threading.Thread(target=run, name="pagedllm-p2p-kv-release", daemon=True).start()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not self.is_consumer:
            return 0, False
        params = kv_transfer_params_of(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        rid = request.request_id
        bs = self.layout.block_size
        max_blocks = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        f = self._fetches.get(rid)
        if f is None:
            if rid in self._done or max_blocks <= 0:
                return 0, False
            f = self._fetches[rid] = _Fetch()
            threading.Thread(target=self._fetch, args=(f, params, list(request.block_hashes[:max_blocks])),
                             name="pagedllm-p2p-kv-fetch", daemon=True).start()
            return None, False
        if not f.done.is_set():
            return None, False
        if f.blocks is None:
            self._fetches.pop(rid, None)
            self._done.add(rid)
            return 0, False
        f.start = num_computed_tokens // bs
        n = max(0, min(len(f.blocks), max_blocks) - f.start)
        return n * bs, False

    def update_state_after_alloc(self, request: Any, blocks: list[Any], num_external_tokens: int) -> None:
        f = self._fetches.get(request.request_id)
        if f is None or not f.done.is_set():
            return
        self._fetches.pop(request.request_id, None)
        self._done.add(request.request_id)
        if f.blocks is None or num_external_tokens <= 0:
            return
        n = num_external_tokens // self.layout.block_size
        assert len(blocks) == n and f.start + n <= len(f.blocks), (n, len(blocks), f.start, len(f.blocks))
        for i, b in enumerate(blocks):
            self._loads.append((b.block_id, f.blocks[f.start + i]))
        with self._lock:
            self.recv.loads += n
            self.recv.load_bytes += n * self.block_bytes
            self.hit_tokens += num_external_tokens

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        params = kv_transfer_params_of(request) or {}
        if self.is_consumer and params.get("do_remote_prefill"):
            f = self._fetches.pop(rid, None)
            if f is None and rid not in self._done and params.get("remote_host"):
                self._release_remote(params)  # aborted before its fetch started: free the producer's copy
            self._done.discard(rid)
        if self.staging is None or not params.get("do_remote_decode"):
            return False, None
        from pagedllm.core.request import RequestStatus

        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        bs = self.layout.block_size
        n = min(len(request.block_hashes), request.num_computed_tokens // bs, len(block_ids))
        keys = list(request.block_hashes[:n])
        ids = dict(zip(keys, block_ids[:n]))
        for k in self.staging.stage(rid, keys):
            self._pending_saves[k] = ids[k]
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingMetadata:
        meta = OffloadingMetadata(saves=list(self._pending_saves.items()), loads=self._loads)
        self._pending_saves = {}
        self._loads = []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if connector_output and self.staging is not None:
            self.staging.saved(connector_output)

    def has_pending_work(self) -> bool:
        return bool(self._pending_saves)

    def get_kv_connector_stats(self) -> dict:
        """``{"tiers": {"p2p_send": {...}, "p2p_recv": {...}}, "transfers": {event: count},
        "hit_tokens", "load_seconds"}``: ``p2p_send`` is the producer's staging buffer (saves =
        blocks staged, loads = blocks sent), ``p2p_recv`` the consumer's side (hits = blocks
        received, loads = blocks copied into the KV cache, errors = failed fetches); transfer events
        ``staged``/``sent``/``released``/``expired``/``evicted`` (producer) and
        ``received``/``failed``/``release_sent`` (consumer)."""
        tiers: dict[str, dict] = {}
        events: dict[str, int] = {}
        if self.staging is not None:
            s = self.staging
            with s.cond:
                tiers["p2p_send"] = {**s.stats.as_dict(), "blocks": len(s.refs), "bytes": s.used_bytes,
                                     "capacity_bytes": s.capacity_bytes}
                events.update(s.events)
        if self.is_consumer:
            with self._lock:
                tiers["p2p_recv"] = {**self.recv.as_dict(), "blocks": 0, "bytes": 0, "capacity_bytes": 0}
                events.update({"received": self.recv_events["received"], "failed": self.recv_events["failed"],
                               "release_sent": self.recv_events["released"]})
        return {"tiers": tiers, "transfers": events, "hit_tokens": self.hit_tokens,
                "load_seconds": self.load_seconds}

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER and getattr(self, "_server", None) is not None:
            self._stop.set()
            srv, self._server = self._server, None
            srv.shutdown()
            srv.server_close()


def _positive_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name}: must be a positive number "
                         f"of seconds, got {v!r}")
    return float(v)
