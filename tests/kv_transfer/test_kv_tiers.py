"""KV tiers without a model: host LRU bound, disk files (format, bound, faults), concurrent
writers, config parsing (pagedllm.distributed.kv_transfer)."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os

import pytest
import torch

from pagedllm.distributed.kv_transfer.base import KVCacheLayout
from pagedllm.distributed.kv_transfer.config import KVTransferConfig, resolve_kv_transfer_config
from pagedllm.distributed.kv_transfer.tiers import DiskTier, HostTier, decode_block, encode_block

LAYOUT = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                       model_fingerprint="a" * 64)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2


def _block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(LAYOUT.block_shape, generator=g).to(torch.bfloat16)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_host_tier_lru_and_bound():
    host = HostTier(5 * BLOCK_BYTES)
    for i in range(5):
        assert host.put(_key(i), _block(i)) == []
    host.get(_key(0))  # most recently used now
    evicted = host.put(_key(5), _block(5))
    assert evicted == [_key(1)]
    for i in range(6, 12):  # fill past the bound
        host.put(_key(i), _block(i))
    assert host.used_bytes <= host.capacity_bytes and len(host) == 5
    assert host.used_bytes == 5 * BLOCK_BYTES
    assert _key(11) in host and _key(0) not in host
    assert host.stats.evictions == 12 - 5
    assert torch.equal(host.get(_key(11)), _block(11))
    tiny = HostTier(BLOCK_BYTES - 1)  # a block larger than the bound is not kept
    assert tiny.put(_key(0), _block(0)) == [] and len(tiny) == 0 and tiny.stats.dropped == 1


def test_block_file_roundtrip_and_checks():
    b = _block(3)
    data = b"".join(bytes(x) for x in encode_block(LAYOUT, _key(3), b))
    assert torch.equal(decode_block(LAYOUT, _key(3), data), b)
    from pagedllm.distributed.kv_transfer.tiers import BlockFileError
    with pytest.raises(BlockFileError, match="truncated"):
        decode_block(LAYOUT, _key(3), data[:-100])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    with pytest.raises(BlockFileError, match="checksum"):
        decode_block(LAYOUT, _key(3), bytes(flipped))
    with pytest.raises(BlockFileError, match="key differs"):
        decode_block(LAYOUT, _key(4), data)
    foreign = KVCacheLayout(**{**LAYOUT.__dict__, "model_fingerprint": "b" * 64})
    with pytest.raises(BlockFileError, match="another model"):
        decode_block(foreign, _key(3), data)
    with pytest.raises(BlockFileError, match="magic"):
        decode_block(LAYOUT, _key(3), b"garbage" * 10)


def test_disk_tier_bound_and_restart(tmp_path):
    file_bytes = None
    disk = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=10**9)
    assert disk.write_now(_key(0), _block(0))
    file_bytes = os.path.getsize(disk.path_of(_key(0)))
    disk.close()
    disk = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=4 * file_bytes)
    assert len(disk) == 1 and _key(0) in disk  # found at start-up
    for i in range(1, 10):  # past the bound, through the writer thread
        assert disk.put(_key(i), _block(i))
    assert disk.flush(30)
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == 4 and disk.used_bytes == sum(os.path.getsize(f) for f in files) <= 4 * file_bytes
    assert disk.stats.evictions == 6
    assert [k for k in (_key(i) for i in range(10)) if k in disk] == [_key(i) for i in range(6, 10)]
    assert torch.equal(disk.get(_key(9)), _block(9))
    disk.close()
    again = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=2 * file_bytes)  # a smaller bound at start-up
    assert len(again) == 2 and again.used_bytes <= 2 * file_bytes
    assert sum(len(fs) for _, _, fs in os.walk(tmp_path)) == 2
    again.close()


def test_disk_tier_ignores_bad_files(tmp_path, caplog):
    disk = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=10**9)
    for i in range(5):
        assert disk.write_now(_key(i), _block(i))
    p = [disk.path_of(_key(i)) for i in range(5)]
    with open(p[0], "r+b") as f:  # corrupted: one byte flipped in the payload
        f.seek(-50, os.SEEK_END)
        c = f.read(1)
        f.seek(-50, os.SEEK_END)
        f.write(bytes([c[0] ^ 0x55]))
    with open(p[1], "r+b") as f:  # truncated (a torn write)
        f.truncate(os.path.getsize(p[1]) // 2)
    other = KVCacheLayout(**{**LAYOUT.__dict__, "model_fingerprint": "c" * 64})
    foreign = DiskTier(str(tmp_path / "x"), other, 10**9)
    foreign.write_now(_key(2), _block(2))
    foreign.close()
    os.replace(foreign.path_of(_key(2)), p[2])  # another model's file under this model's name
    os.unlink(p[3])
    os.mkdir(p[3])  # a read error (EISDIR)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert [disk.get(_key(i)) is None for i in range(5)] == [True, True, True, True, False]
    text = caplog.text
    assert "checksum" in text and "truncated" in text and "another model" in text and "cannot read" in text
    assert disk.stats.errors == 4
    assert all(_key(i) not in disk for i in range(4))  # never offered again
    assert torch.equal(disk.get(_key(4)), _block(4))
    disk.close()


def test_disk_tier_full_disk_and_killed_writer(tmp_path, caplog):
    disk = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=10**9)
    real_open = disk._open_tmp
    # a full disk: the kernel's ENOSPC from /dev/full
    disk._open_tmp = lambda path: (real_open(path)[0], open("/dev/full", "wb"))
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert not disk.write_now(_key(0), _block(0))
    assert "disk full" in caplog.text and disk.stats.errors == 1
    assert _key(0) not in disk and not any(f.endswith(".tmp") for _, _, fs in os.walk(tmp_path) for f in fs)
    disk._open_tmp = real_open
    assert disk.write_now(_key(0), _block(0))
    disk.close()
    # a writer killed mid-file leaves a temporary file: never indexed or loaded, swept when stale
    tmp = disk.path_of(_key(1)) + ".999.1.1.tmp"
    head, payload, _ = encode_block(LAYOUT, _key(1), _block(1))
    with open(tmp, "wb") as f:
        f.write(head + bytes(payload)[:100])
    os.utime(tmp, (1, 1))
    again = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=10**9)
    assert _key(1) not in again and again.get(_key(1)) is None
    assert not os.path.exists(tmp) and len(again) == 1
    again.close()


def _writer(root: str, start: int, n: int) -> None:
    disk = DiskTier(root, LAYOUT, capacity_bytes=10**9)
    for r in range(3):
        for i in range(start, start + n):
            disk.write_now(_key(i), _block(i))
    disk.close()


def test_concurrent_writers_share_a_directory(tmp_path):
    ctx = mp.get_context("fork")
    # two processes write overlapping block sets into one directory at the same time, three times over
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s, 24)) for s in (0, 12)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    disk = DiskTier(str(tmp_path), LAYOUT, capacity_bytes=10**9)
    assert len(disk) == 36
    for i in range(36):
        assert torch.equal(disk.get(_key(i)), _block(i)), i
    assert disk.stats.errors == 0
    assert not any(f.endswith(".tmp") for _, _, fs in os.walk(tmp_path) for f in fs)
    disk.close()


def test_transfer_config_parsing():
    cfg = KVTransferConfig.from_any('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}')
    assert cfg.kv_connector == "OffloadingConnector" and cfg.is_kv_producer and cfg.is_kv_consumer
    for bad, field in [('{"kv_role": "kv_both"}', "kv_connector"), ('{"kv_connector": "X", "kv_role": "both"}', "kv_role"),
                       ("[1]", "JSON object"), ("{", "invalid JSON"), ('{"kv_connectr": "X"}', "unknown field")]:
        with pytest.raises(ValueError, match=field):
            KVTransferConfig.from_any(bad)
    cfg = resolve_kv_transfer_config(None, kv_offloading_size=1.5, kv_cache_dir="/x", kv_cache_dir_size=2)
    assert cfg.kv_connector == "OffloadingConnector" and cfg.kv_role == "kv_both"
    assert cfg.kv_connector_extra_config == {"cpu_bytes_to_use": int(1.5 * 1024**3), "kv_cache_dir": "/x",
                                             "disk_bytes_to_use": 2 * 1024**3}
    assert resolve_kv_transfer_config(None) is None
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        resolve_kv_transfer_config(None, kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_size"):
        resolve_kv_transfer_config(None, kv_offloading_size=0)
    with pytest.raises(ValueError, match="kv_cache_dir_size"):
        resolve_kv_transfer_config(None, kv_cache_dir_size=1)
    with pytest.raises(ValueError, match="OffloadingConnector"):
        resolve_kv_transfer_config({"kv_connector": "Other"}, kv_offloading_size=1)


def test_factory_registry():
    from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory
    from pagedllm.distributed.kv_transfer.offloading import OffloadingConnector

    assert "OffloadingConnector" in KVConnectorFactory.names()
    assert KVConnectorFactory.get_connector_class(KVTransferConfig("OffloadingConnector")) is OffloadingConnector
    with pytest.raises(ValueError, match="unknown connector 'Nope'.*OffloadingConnector"):
        KVConnectorFactory.get_connector_class(KVTransferConfig("Nope"))
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("OffloadingConnector", "x", "y")
