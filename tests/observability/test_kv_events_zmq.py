"""KV cache events over ZeroMQ (--kv-events-config), received by a real SUB socket and decoded
with msgspec structs declared here after vLLM's ``vllm.distributed.kv_events`` (an array batch
``[ts, events, data_parallel_rank]`` of "type"-tagged event maps): the publisher's queue bound
(overflow dropped, counted, visible as a seq gap and on /metrics), the offline LLM's stored /
removed / cleared events, and the server's /metrics counters."""
from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq
from fastapi.testclient import TestClient

from obs_helpers import TINY_KW
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.kv_events import KVEventPublisher, KVEventsConfig
from server_helpers import free_port


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Optional[Union[int, bytes]]
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
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _sub(endpoint: str, topic: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return sock


def _recv_all(sock: zmq.Socket, idle_ms: int = 300) -> list[tuple[bytes, int, bytes]]:
    out = []
    while sock.poll(idle_ms):
        topic, seq, payload = sock.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.005)


def test_queue_bound_overflow_dropped_counted_and_seq_gap():
    ep = f"inproc://kv-events-test-{time.monotonic_ns()}"
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=ep, topic="kv",
                                          max_queue_size=2), start=False)
    sub = _sub(ep, "kv")
    try:
        time.sleep(0.2)  # let the subscription reach the PUB socket
        h = [bytes([i]) * 32 for i in range(4)]
        for i in range(5):  # the sender thread is not started: 2 fit, 3 are dropped
            pub.publish([("stored", [h[i % 4]], None, [1, 2, 3, 4], 4, None, None)])
        st = pub.stats()
        assert st["kv_events_queue_batches"] == 2 and st["kv_events_queue_capacity"] == 2
        assert st["kv_events_batches_dropped_total"] == 3 and st["kv_events_batches_published_total"] == 0
        pub.start()
        _wait(lambda: pub.stats()["kv_events_batches_published_total"] == 2)
        pub.publish([("removed", [h[0], h[1]]), ("cleared",)])
        msgs = _recv_all(sub)
    finally:
        pub.shutdown()
        sub.close(linger=0)
    assert [(t, seq) for t, seq, _ in msgs] == [(b"kv", 0), (b"kv", 1), (b"kv", 5)]  # 2..4 dropped: a gap
    b0 = DECODER.decode(msgs[0][2])
    (ev,) = b0.events
    assert isinstance(ev, BlockStored) and b0.data_parallel_rank == 0
    assert ev.block_hashes == [int.from_bytes(h[0][-8:], "big")] and ev.parent_block_hash is None
    assert (ev.token_ids, ev.block_size, ev.medium, ev.group_idx) == ([1, 2, 3, 4], 4, "GPU", 0)
    b2 = DECODER.decode(msgs[2][2])
    assert isinstance(b2.events[0], BlockRemoved) and isinstance(b2.events[1], AllBlocksCleared)
    assert b2.events[0].block_hashes == [int.from_bytes(x[-8:], "big") for x in h[:2]]
    raw = msgspec.msgpack.decode(msgs[2][2])  # the shape on the wire
    assert isinstance(raw, list) and raw[1][1] == {"type": "AllBlocksCleared"} and raw[2] == 0
    assert raw[1][0]["type"] == "BlockRemoved"

    from pagedllm.metrics.prometheus import PrometheusStatLogger
    prom = PrometheusStatLogger(model_name="m")
    prom.record_kv_events(pub.stats())
    text = prom.render().decode()
    assert 'pagedllm:kv_events_batches_dropped_total{model_name="m"} 3.0' in text
    assert 'pagedllm:kv_events_batches_published_total{model_name="m"} 3.0' in text
    assert 'pagedllm:kv_events_queue_capacity{model_name="m"} 2.0' in text


def test_config_errors():
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")
    with pytest.raises(ValueError, match="unknown field 'bogus'"):
        KVEventsConfig.from_any('{"bogus": 1}')
    with pytest.raises(ValueError, match="max_queue_size"):
        KVEventsConfig.from_any({"enable_kv_cache_events": True, "max_queue_size": 0})
    assert KVEventsConfig().publisher == "null" and KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser, normalize_args
    with pytest.raises(ValueError, match="--kv-events-config: kv_events_config.publisher"):
        normalize_args(make_arg_parser().parse_args(["--kv-events-config", '{"publisher": "x"}']))


def _joined(llm, sub) -> None:
    """Until the SUB socket receives something, reset the (empty) prefix cache, which publishes an
    AllBlocksCleared batch (the PUB drops messages until the subscription has arrived); then drain."""
    deadline = time.time() + 30
    while True:
        assert llm.reset_prefix_cache()
        if sub.poll(100):
            break
        assert time.time() < deadline, "subscriber never joined"
    _recv_all(sub, 200)


def test_llm_publishes_stored_removed_cleared(tiny_model):
    port = free_port()
    llm = LLM(tiny_model, kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                            "topic": "kv-events"}, **{**TINY_KW, "kv_cache_memory": "32KiB"})
    sub = _sub(f"tcp://127.0.0.1:{port}", "kv-events")
    try:
        _joined(llm, sub)
        pool = llm.llm_engine.core.kv_cache_manager.block_pool
        nblocks = pool.num_usable_blocks
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        shared = [5, 17, 3, 88, 42, 9, 61, 23]  # two full blocks
        a = shared + [7, 70, 31, 2, 11]
        b = shared + [100, 101, 102, 103, 104]
        llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)
        llm.generate([{"prompt_token_ids": b}], sp, use_tqdm=False)
        first = [DECODER.decode(p) for _, _, p in _recv_all(sub)]
        # Enough distinct prompts to cycle the whole pool: cached blocks get evicted.
        for i in range(nblocks // 8 + 2):
            llm.generate([{"prompt_token_ids": [(30 + i * 7 + j) % 250 + 3 for j in range(30)]}], sp,
                         use_tqdm=False)
        later = [DECODER.decode(p) for _, _, p in _recv_all(sub)]
        assert llm.reset_prefix_cache()
        last = [DECODER.decode(p) for _, _, p in _recv_all(sub)]
    finally:
        llm.llm_engine.shutdown()
        sub.close(linger=0)
    stored = [e for bt in first for e in bt.events if isinstance(e, BlockStored)]
    # a: 13 prompt tokens = 3 full blocks, stored by its prefill; b hits a's first two blocks and
    # stores only its third, chained on a's second. The shared prefix is announced once.
    assert [(e.token_ids, len(e.block_hashes)) for e in stored] == [(a[:12], 3), (b[8:12], 1)]
    sa, sb = stored
    assert sa.parent_block_hash is None and sb.parent_block_hash == sa.block_hashes[1]
    assert all((e.block_size, e.medium, e.lora_id, e.group_idx) == (4, "GPU", None, 0) for e in stored)
    all_stored = {h for bt in first + later for e in bt.events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = [h for bt in later for e in bt.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    # Every removal names a block announced before, once; the oldest (a's) were evicted.
    assert removed and set(removed) <= all_stored and len(set(removed)) == len(removed)
    assert set(sa.block_hashes) <= set(removed)
    assert any(isinstance(e, AllBlocksCleared) for bt in last for e in bt.events)
    assert all(bt.data_parallel_rank == 0 and bt.ts > 0 for bt in first + later + last)


def test_server_metrics_count_published_batches(tiny_model):
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    port = free_port()
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model, kv_events_config=(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}", "max_queue_size": 64}}'), **TINY_KW))
    try:
        with TestClient(build_app(engine)) as client:
            r = client.post("/v1/completions", json={"prompt": [5, 17, 3, 88, 42, 9, 61, 23, 7], "max_tokens": 2})
            assert r.status_code == 200
            pub = engine.engine.core.kv_events
            _wait(lambda: pub.stats()["kv_events_batches_published_total"] >= 1)
            n = pub.stats()["kv_events_batches_published_total"]
            text = client.get("/metrics").text
    finally:
        engine.shutdown()
    assert "pagedllm:kv_events_queue_capacity{model_name=" in text and "} 64.0" in text
    line = [x for x in text.splitlines() if x.startswith("pagedllm:kv_events_batches_published_total")][0]
    assert float(line.split()[-1]) == n
    assert [x for x in text.splitlines() if x.startswith("pagedllm:kv_events_batches_dropped_total")][0].endswith(" 0.0")


def test_bad_endpoint_is_a_start_up_error(tiny_model):
    with pytest.raises(ValueError, match="kv_events_config.endpoint"):
        LLM(tiny_model, kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:notaport"}, **TINY_KW)
