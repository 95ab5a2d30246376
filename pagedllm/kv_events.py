"""KV cache events (vLLM's ``--kv-events-config``): the prefix cache's stored / removed blocks,
published over ZeroMQ for a prefix-aware router.

Configuration: ``KVEventsConfig`` (vLLM's fields and defaults): ``enable_kv_cache_events``,
``publisher`` ("zmq" | "null"; default "zmq" when events are enabled), ``endpoint``
("tcp://*:5557": bind when it holds ``*``, ``::``, ``ipc://`` or ``inproc://``, else connect),
``replay_endpoint`` (a ROUTER socket serving past batches), ``buffer_steps`` (batches kept for
replay), ``hwm`` (the PUB socket's high-water mark), ``max_queue_size`` (batches waiting for the
publisher thread) and ``topic``. Data-parallel replica ``r`` adds ``r`` to the endpoints' ports
(vLLM's rule).

Wire format (vLLM's ``vllm.distributed.kv_events``, as its current releases send it): every
engine step that changed the prefix cache publishes one three-frame message ``[topic, seq,
payload]``, ``seq`` an 8-byte big-endian counter and ``payload`` the msgpack (``msgspec``)
encoding of a ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]`` (``ts`` in
``time.time()`` seconds), each event a map tagged by ``"type"``:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash`` (None for a prompt's first block),
  ``token_ids`` (the blocks' tokens), ``block_size``, ``lora_id``, ``medium`` ("GPU": vLLM's
  name for the engine's own KV cache tier), ``lora_name``, ``group_idx`` (0),
  ``kv_cache_spec_kind`` ("full_attention");
* ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
* ``AllBlocksCleared``: no fields (``/reset_prefix_cache``).

Block hashes are the low 64 bits of pagedllm's block hash as an unsigned int (vLLM's default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); set ``PAGEDLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (or
vLLM's variable) for the full hash bytes. pagedllm's hashes chain on a per-process random root,
so they are identifiers to match stored against removed events, not recomputable outside.

Bound: the queue between the engine and the publisher thread holds at most ``max_queue_size``
batches; a batch that finds it full is dropped (the engine never waits) and counted
(``stats()["kv_events_batches_dropped_total"]``, ``P:kv_events_batches_dropped_total`` on
/metrics). ``seq`` is assigned when a batch is queued, so a subscriber sees a dropped batch as a
gap in ``seq`` (and should resynchronise). ``pyzmq`` and ``msgspec`` are imported only when
events are enabled.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.config import dataclass_from_json

logger = logging.getLogger("pagedllm")

#: ``publisher`` values.
PUBLISHERS = ("null", "zmq")
#: vLLM's ``medium`` of the engine's own KV cache.
MEDIUM = "GPU"


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (same fields and defaults; see the module docstring).

    Raises (``__post_init__``):
        ValueError: an unknown publisher or a bound below 1 (naming the field).
    """

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher: expected one of {list(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kv_events_config.{name}: must be an integer >= 1, got {v!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events: must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name}: must be a string, got {getattr(self, name)!r}")

    @classmethod
    def from_any(cls, value: Any) -> Optional["KVEventsConfig"]:
        """A config from None, a dict, a JSON object string or a KVEventsConfig.

        Raises:
            ValueError: invalid JSON, not an object, an unknown field or a bad value (naming it).
        """
        if value is None or isinstance(value, cls):
            return value
        return dataclass_from_json(cls, value, "kv_events_config")


def offset_endpoint_port(endpoint: Optional[str], data_parallel_rank: int) -> Optional[str]:
    """``endpoint`` for data-parallel replica ``data_parallel_rank`` (vLLM's rule): tcp ports
    are offset by the rank, inproc/ipc names get a ``_dp{rank}`` suffix; rank 0 unchanged.

    Raises:
        ValueError: a tcp endpoint whose port is not a number.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        try:
            return f"{base}:{int(port) + data_parallel_rank}"
        except ValueError:
            raise ValueError(f"kv_events_config.endpoint: no port number in {endpoint!r}") from None
    return f"{endpoint}_dp{data_parallel_rank}"


def _int_hashes() -> bool:
    from pagedllm import envs
    return bool(envs.get("PAGEDLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"))


_STRUCTS: Optional[dict] = None


def event_structs() -> dict:
    """vLLM's msgspec event classes (``EventBatch``, ``KVEventBatch``, ``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``), built on first use (msgspec is optional)."""
    global _STRUCTS
    if _STRUCTS is not None:
        return _STRUCTS
    import msgspec

    ExternalBlockHash = Any  # int (default) or bytes

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        """Base of the KV cache events (tagged by class name under "type")."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: Optional[ExternalBlockHash]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    _STRUCTS = dict(EventBatch=EventBatch, KVEventBatch=KVEventBatch, BlockStored=BlockStored,
                    BlockRemoved=BlockRemoved, AllBlocksCleared=AllBlocksCleared)
    return _STRUCTS


def to_wire_events(raw: list[tuple], int_hashes: bool = True) -> list:
    """The block pool's raw events (``BlockPool.kv_events``) as vLLM's msgspec event objects."""
    S = event_structs()

    def conv(h: Optional[bytes]) -> Any:
        if h is None or not int_hashes:
            return h
        return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF

    out = []
    for ev in raw:
        kind = ev[0]
        if kind == "stored":
            _, hashes, parent, tokens, bs, lora_id, lora_name = ev
            out.append(S["BlockStored"](
                block_hashes=[conv(h) for h in hashes], parent_block_hash=conv(parent), token_ids=tokens,
                block_size=bs, lora_id=lora_id, medium=MEDIUM, lora_name=lora_name, group_idx=0,
                kv_cache_spec_kind="full_attention"))
        elif kind == "removed":
            out.append(S["BlockRemoved"](block_hashes=[conv(h) for h in ev[1]], medium=MEDIUM, group_idx=0))
        else:
            out.append(S["AllBlocksCleared"]())
    return out


class KVEventPublisher:
    """Publishes the block pool's events, one batch per engine step (see the module docstring).

    ``publish(raw_events)`` runs on the engine thread and only queues (never blocks); a daemon
    thread converts, encodes and sends. The "null" publisher counts batches and sends nothing.

    Args:
        config: the KVEventsConfig (``publisher`` "zmq" or "null").
        data_parallel_rank: this replica's rank (port offset, and the batch's rank field).
        start: start the sending thread now (False: call ``start()``; tests fill the queue first).

    Raises:
        ImportError: "zmq" without ``pyzmq`` / ``msgspec`` (the message names the packages).
        ValueError: the endpoint cannot be bound or connected (naming the field).
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, start: bool = True) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.capacity = config.max_queue_size
        self._queue: "queue.Queue[Optional[tuple[int, float, list]]]" = queue.Queue(maxsize=config.max_queue_size)
        self._seq = 0
        self.num_published = 0
        self.num_dropped = 0
        self._int_hashes = _int_hashes()
        self._pub = self._replay = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._stop_now = False
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        if config.publisher == "zmq":
            try:
                import msgspec  # noqa: F401
                import zmq
            except ImportError as e:
                raise ImportError(f"kv_events_config: publisher 'zmq' needs the pyzmq and msgspec packages "
                                  f"(pip install pyzmq msgspec, or pip install 'pagedllm[kv-events]'): {e}") from None
            event_structs()
            ctx = zmq.Context.instance()
            self._pub = ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            ep = self.endpoint
            try:
                if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                    self._pub.bind(ep)
                else:
                    self._pub.connect(ep)
            except zmq.ZMQError as e:
                self._pub.close(linger=0)
                raise ValueError(f"kv_events_config.endpoint: cannot bind or connect {ep!r}: {e}") from None
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                try:
                    self._replay.bind(self.replay_endpoint)
                except zmq.ZMQError as e:
                    self._pub.close(linger=0)
                    self._replay.close(linger=0)
                    raise ValueError(f"kv_events_config.replay_endpoint: cannot bind {self.replay_endpoint!r}: "
                                     f"{e}") from None
            self._buffer: deque = deque(maxlen=config.buffer_steps)
            if start:
                self.start()

    def start(self) -> None:
        """Start the sending thread (idempotent; nothing for the null publisher)."""
        if self._pub is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
            self._thread.start()

    def publish(self, raw_events: list[tuple]) -> bool:
        """Queue one batch (``BlockPool.take_kv_events()``); empty lists are skipped. Returns
        False when the batch was dropped (queue full, or closed)."""
        if not raw_events:
            return True
        seq = self._seq
        self._seq += 1
        if self._closed:
            self.num_dropped += 1
            return False
        if self._pub is None:  # the null publisher: counted, not sent
            self.num_published += 1
            return True
        try:
            self._queue.put_nowait((seq, time.time(), raw_events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("pagedllm: KV events queue full (%d batches, kv_events_config.max_queue_size); "
                               "%d batch(es) dropped so far", self.capacity, self.num_dropped)
            return False
        return True

    def stats(self) -> dict:
        """Counters for /metrics: ``kv_events_queue_batches`` (queued now),
        ``kv_events_queue_capacity``, ``kv_events_batches_published_total``,
        ``kv_events_batches_dropped_total``."""
        return {"kv_events_queue_batches": self._queue.qsize(), "kv_events_queue_capacity": self.capacity,
                "kv_events_batches_published_total": self.num_published,
                "kv_events_batches_dropped_total": self.num_dropped}

    def _run(self) -> None:
        import msgspec

        enc = msgspec.msgpack.Encoder()
        S = event_structs()
        topic = self.config.topic.encode("utf-8")
        while not self._stop_now:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("pagedllm: KV events replay failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, raw = item
            try:
                batch = S["KVEventBatch"](ts=ts, events=to_wire_events(raw, self._int_hashes),
                                          data_parallel_rank=self.data_parallel_rank)
                payload = enc.encode(batch)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((topic, seq_bytes, payload))
                self._buffer.append((seq_bytes, payload))
                self.num_published += 1
            except Exception:
                logger.exception("pagedllm: publishing KV events failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        """Answer one replay request ``[identity, b"", start_seq (8 bytes)]`` with every buffered
        batch from that seq on, then ``END_SEQ`` (vLLM's protocol)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq_bytes, payload in list(self._buffer):
            if int.from_bytes(seq_bytes, "big") >= start_seq:
                self._replay.send_multipart((ident, b"", seq_bytes, payload))
        self._replay.send_multipart((ident, b"", self.END_SEQ, b""))

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout=timeout)
            self._stop_now = True
            self._thread.join(timeout=timeout)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def make_publisher(value: Any, data_parallel_rank: int = 0) -> Optional[KVEventPublisher]:
    """The publisher for ``EngineArgs.kv_events_config``, or None when events are off
    (``enable_kv_cache_events`` false, or no config).

    Raises:
        ValueError: a bad config; ImportError: "zmq" without its packages.
    """
    cfg = KVEventsConfig.from_any(value)
    if cfg is None or not cfg.enable_kv_cache_events:
        return None
    return KVEventPublisher(cfg, data_parallel_rank)
