"""P2pConnector without a model: config errors, the staging buffer's bound and refcounts, and the
wire protocol between a producer and a consumer scheduler half in one process."""
from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch

from pagedllm.core.request import RequestStatus
from pagedllm.distributed.kv_transfer.base import KVCacheLayout, KVConnectorRole
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.distributed.kv_transfer.p2p import P2pConnector, _Staging, prefill_response_params

LAYOUT = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                       model_fingerprint="f" * 64)
BB = 2 * 2 * 4 * 2 * 8 * 4  # bytes per block


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(role: str, port: int = 0, **extra) -> KVTransferConfig:
    d = {"kv_connector": "P2pConnector", "kv_role": role, "kv_connector_extra_config": extra}
    if port:
        d["kv_port"] = port
    return KVTransferConfig.from_any(d)


def _req(rid: str, n_tokens: int, params: dict, status=RequestStatus.FINISHED_LENGTH):
    keys = [bytes([i]) * 32 for i in range(n_tokens // 4)]
    return SimpleNamespace(request_id=rid, block_hashes=keys, num_computed_tokens=n_tokens, num_tokens=n_tokens + 1,
                           sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": params}), status=status)


def _stage(prod: P2pConnector, req, seed: int = 0) -> dict[bytes, torch.Tensor]:
    """Run the producer through request_finished -> the step's saves -> the worker's output."""
    prod.request_finished(req, list(range(10, 10 + len(req.block_hashes))))
    meta = prod.build_connector_meta(None)
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(LAYOUT.block_shape, generator=g) for k, _ in meta.saves}
    prod.update_connector_output(out)
    return out


def test_config_errors():
    with pytest.raises(ValueError, match="kv_transfer_config.kv_port"):
        KVTransferConfig.from_any({"kv_connector": "P2pConnector", "kv_port": 70000})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_ip"):
        KVTransferConfig.from_any({"kv_connector": "P2pConnector", "kv_ip": 5})
    with pytest.raises(ValueError, match="unknown key"):
        P2pConnector(_cfg("kv_consumer", cpu_bytes_to_use=1), KVConnectorRole.SCHEDULER, LAYOUT)
    with pytest.raises(ValueError, match="abort_request_timeout_s"):
        P2pConnector(_cfg("kv_producer", _port(), abort_request_timeout_s=0), KVConnectorRole.SCHEDULER, LAYOUT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ValueError, match="kv_transfer_config.kv_port: cannot listen"):
            P2pConnector(_cfg("kv_producer", s.getsockname()[1]), KVConnectorRole.SCHEDULER, LAYOUT)


def test_prefill_response_params():
    cfg = {"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": 1234}
    p = prefill_response_params(cfg, {"do_remote_decode": True}, "cmpl-1-0")
    assert p == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "127.0.0.1:1234",
                 "remote_host": "127.0.0.1", "remote_port": 1234, "remote_request_id": "cmpl-1-0",
                 "remote_block_ids": None}
    assert prefill_response_params(cfg, {"do_remote_decode": False}, "x") is None
    assert prefill_response_params({**cfg, "kv_role": "kv_consumer"}, {"do_remote_decode": True}, "x") is None
    assert prefill_response_params(None, {"do_remote_decode": True}, "x") is None


def test_staging_bound_and_refcounts():
    s = _Staging(capacity_bytes=5 * BB, block_bytes=BB, timeout_s=100)
    a, b, c = (bytes([i]) * 4 for i in range(3))
    assert s.stage("r1", [a, b]) == [a, b]
    assert s.stage("r2", [a, b, c]) == [c]  # shared prefix staged once
    assert s.used_bytes == 3 * BB
    s.release("r1")
    assert s.used_bytes == 3 * BB  # r2 still holds a, b
    keys = [bytes([10 + i]) * 4 for i in range(7)]
    new = s.stage("r3", keys)  # 7 blocks > 5: r2 is evicted, then the longest prefix that fits
    assert s.events["evicted"] == 1 and "r2" not in s.transfers
    assert new == keys[:5] and s.stats.dropped == 2 and s.used_bytes == 5 * BB <= s.capacity_bytes
    s.timeout_s = 0
    s.transfers["r3"].deadline = time.monotonic() - 1
    s.expire()
    assert s.used_bytes == 0 and s.events["expired"] == 1


def test_transfer_over_tcp_and_faults():
    port = _port()
    prod = P2pConnector(_cfg("kv_producer", port, buffer_bytes_to_use=64 * BB), KVConnectorRole.SCHEDULER, LAYOUT)
    cons = P2pConnector(_cfg("kv_consumer", transfer_timeout_s=2), KVConnectorRole.SCHEDULER, LAYOUT)
    try:
        req = _req("p-1", 18, {"do_remote_decode": True})
        blocks = _stage(prod, req)
        assert len(blocks) == 4 and prod.get_kv_connector_stats()["tiers"]["p2p_send"]["bytes"] == 4 * BB
        # an aborted prefill stages nothing
        prod.request_finished(_req("p-2", 18, {"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED), [1, 2])
        assert not prod.has_pending_work()
        params = prefill_response_params(prod.config, {"do_remote_decode": True}, "p-1")
        d = _req("d-1", 18, params)
        d.num_computed_tokens = 0
        assert cons.get_num_new_matched_tokens(d, 4) == (None, False)  # fetching; the device holds block 0
        deadline = time.time() + 10
        while (n := cons.get_num_new_matched_tokens(d, 4)[0]) is None and time.time() < deadline:
            time.sleep(0.01)
        assert n == 3 * 4
        cons.update_state_after_alloc(d, [SimpleNamespace(block_id=7 + i) for i in range(3)], 12)
        loads = cons.build_connector_meta(None).loads
        assert [b for b, _ in loads] == [7, 8, 9]
        for (_, t), k in zip(loads, req.block_hashes[1:4]):
            assert torch.equal(t, blocks[k])
        st = prod.get_kv_connector_stats()
        assert st["transfers"]["sent"] == 1 and st["tiers"]["p2p_send"]["bytes"] == 0  # freed once fetched
        assert cons.get_kv_connector_stats()["tiers"]["p2p_recv"]["load_bytes"] == 3 * BB
        # a decoder aborted before its fetch releases the producer's copy
        _stage(prod, _req("p-3", 18, {"do_remote_decode": True}), seed=1)
        cons.request_finished(_req("d-3", 18, {**params, "remote_request_id": "p-3"}), [])
        deadline = time.time() + 10
        while prod.get_kv_connector_stats()["tiers"]["p2p_send"]["bytes"] and time.time() < deadline:
            time.sleep(0.01)
        assert prod.get_kv_connector_stats()["transfers"]["released"] >= 1
        assert prod.get_kv_connector_stats()["tiers"]["p2p_send"]["bytes"] == 0
        # another layout (another model) is rejected: recompute
        other = P2pConnector(_cfg("kv_consumer"), KVConnectorRole.SCHEDULER,
                             KVCacheLayout(**{**LAYOUT.__dict__, "model_fingerprint": "0" * 64}))
        _stage(prod, _req("p-4", 18, {"do_remote_decode": True}))
        d4 = _req("d-4", 18, {**params, "remote_request_id": "p-4"})
        assert other.get_num_new_matched_tokens(d4, 0) == (None, False)
        deadline = time.time() + 10
        while (n := other.get_num_new_matched_tokens(d4, 0)[0]) is None and time.time() < deadline:
            time.sleep(0.01)
        assert n == 0 and other.get_kv_connector_stats()["transfers"]["failed"] == 1
        # a dead producer: recompute
        d5 = _req("d-5", 18, {**params, "remote_port": _port()})
        assert cons.get_num_new_matched_tokens(d5, 0) == (None, False)
        deadline = time.time() + 10
        while (n := cons.get_num_new_matched_tokens(d5, 0)[0]) is None and time.time() < deadline:
            time.sleep(0.01)
        assert n == 0 and cons.get_kv_connector_stats()["transfers"]["failed"] == 1
    finally:
        prod.shutdown()
