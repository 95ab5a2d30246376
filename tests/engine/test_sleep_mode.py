"""Sleep mode (issue 37.6): ``LLM.sleep(level)`` / ``wake_up(tags)`` and the server's ``/sleep``,
``/wake_up``, ``/is_sleeping`` on a tiny random Llama (float32 and bf16 with oneDNN-packed
weights); the real-model memory figures come from ``benchmarks/sleep_memory.py``."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_llama_ckpt import write_tiny_llama  # noqa: E402

PROMPTS = ["w1 w2 w3 w4", "w9 w8 w7 w6 w5 w4 w3 w2 w1 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sleep_tiny"))
    write_tiny_llama(d, seed=3)
    return d


def _sig(outs):
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def _weight_storage_bytes(llm) -> int:
    m = llm.llm_engine.core.model
    return sum(p.untyped_storage().nbytes() for p in m.parameters())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sleep_wake_levels_outputs_identical(tiny_dir, dtype):
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.sleep import EngineSleepingError

    llm = LLM(tiny_dir, enable_sleep_mode=True, kv_cache_memory="8MiB", dtype=dtype, max_num_batched_tokens=64)
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=3)
    ref = _sig(llm.generate(PROMPTS, sp, use_tqdm=False))
    core = llm.llm_engine.core
    weights = _weight_storage_bytes(llm)
    assert weights > 0 and core.get_memory_stats()["kv_cache_committed_bytes"] > 0
    for level in (1, 2, 1):
        llm.sleep(level=level)
        assert llm.is_sleeping() and core.sleeping_tags == {"weights", "kv_cache"}
        # KV pages given back, prefix cache forgotten, weights freed
        assert core.get_memory_stats()["kv_cache_committed_bytes"] == 0
        assert core.kv_cache_manager.block_pool.num_committed_blocks == 0
        assert _weight_storage_bytes(llm) == 0
        if dtype == "bfloat16":
            assert all(getattr(m, "onednn_weight", None) is None for m in core.model.modules())
        with pytest.raises(EngineSleepingError, match="sleeping"):
            llm.generate(PROMPTS, sp, use_tqdm=False)
        llm.sleep(level=level)  # asleep already: a no-op
        llm.wake_up()
        assert not llm.is_sleeping()
        assert _weight_storage_bytes(llm) == weights
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert _sig(outs) == ref, f"level {level}"
        assert all(o.num_cached_tokens == 0 for o in outs)  # the prefix cache was reset by the sleep
        # and it works again after the wake: the second run hits it
        assert llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].num_cached_tokens > 0


def test_sleep_frees_a_kv_cache_allocated_up_front(tiny_dir, monkeypatch):
    """PAGEDLLM_KV_LAZY=0: the zero-filled caches are freed asleep and zero-filled again on wake."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_KV_LAZY", "0")
    llm = LLM(tiny_dir, enable_sleep_mode=True, kv_cache_memory="4MiB", dtype="float32")
    caches = llm.llm_engine.core.runner.kv_caches
    nbytes = sum(t.untyped_storage().nbytes() for t in caches)
    sp = SamplingParams(temperature=0, max_tokens=8)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    llm.sleep(1)
    assert nbytes > 0 and sum(t.untyped_storage().nbytes() for t in caches) == 0
    llm.wake_up()
    assert sum(t.untyped_storage().nbytes() for t in caches) == nbytes
    assert all(int(t.count_nonzero()) == 0 for t in caches)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref


def test_wake_up_tags_and_bad_arguments(tiny_dir):
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.sleep import EngineSleepingError

    llm = LLM(tiny_dir, enable_sleep_mode=True, kv_cache_memory="8MiB", dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=6)
    ref = llm.generate(PROMPTS, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    assert not llm.is_sleeping()
    llm.sleep(1)
    with pytest.raises(ValueError, match="unknown sleep tag 'gpu'"):
        llm.wake_up(tags=["gpu"])
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and llm.llm_engine.core.sleeping_tags == {"kv_cache"}
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS, sp, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    llm.wake_up()  # nothing asleep: a no-op
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in ref]


def test_sleep_without_sleep_mode_is_a_clear_error(tiny_dir):
    from pagedllm import LLM

    llm = LLM(tiny_dir, kv_cache_memory="8MiB", dtype="float32")
    for call in (lambda: llm.sleep(1), lambda: llm.wake_up()):
        with pytest.raises(ValueError, match=r"sleep mode is not enabled; start the engine with "
                                             r"enable_sleep_mode=True \(pagedllm serve --enable-sleep-mode\)"):
            call()


def test_level1_backup_goes_to_sleep_dir(tiny_dir, tmp_path, monkeypatch):
    """The level-1 copy is an unlinked file in PAGEDLLM_SLEEP_DIR: the directory stays empty, and
    the process holds one deleted file there of the weights' size while asleep."""
    from pagedllm import LLM

    monkeypatch.setenv("PAGEDLLM_SLEEP_DIR", str(tmp_path))
    llm = LLM(tiny_dir, enable_sleep_mode=True, kv_cache_memory="8MiB", dtype="float32")
    weights = _weight_storage_bytes(llm)
    llm.sleep(1)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(tmp_path)):
            held.append(os.fstat(int(fd)).st_size)
    assert os.listdir(tmp_path) == []
    assert len(held) == 1 and held[0] >= weights
    llm.wake_up()
    assert not any(os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
                   for fd in os.listdir("/proc/self/fd") if os.path.islink(f"/proc/self/fd/{fd}"))


def test_offload_restore_views_and_numpy_tensors(tmp_path, monkeypatch):
    """``offload``/``restore`` directly: views of a resizable storage, a numpy-backed
    (non-resizable) tensor and its view; level 1 gives the same bytes back."""
    import numpy as np

    from pagedllm.models.layers import Linear
    from pagedllm.worker.sleep import offload, restore

    monkeypatch.setenv("PAGEDLLM_SLEEP_DIR", str(tmp_path))
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.lin = Linear(64, 32)
    with torch.no_grad():
        m.lin.weight.normal_()
        m.lin.bias.normal_()
    m.rows = m.lin.weight[3:7]
    m.np_table = torch.from_numpy(np.arange(40, dtype=np.float32))
    m.np_view = m.np_table[5:9]
    ref = [t.clone() for t in (m.lin.weight, m.lin.bias, m.rows, m.np_table, m.np_view)]
    state = offload([m], 1)
    assert m.lin.weight.untyped_storage().nbytes() == 0 and m.np_table.numel() == 0
    assert state.nbytes >= sum(t.numel() * t.element_size() for t in ref[:2]) + 40 * 4
    restore(state)
    got = (m.lin.weight, m.lin.bias, m.rows, m.np_table, m.np_view)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert m.rows.data_ptr() == m.lin.weight.data_ptr() + 3 * 64 * 4  # still a view
    assert m.np_view.data_ptr() == m.np_table.data_ptr() + 5 * 4


def test_offload_restore_onednn_packed_weight(tmp_path, monkeypatch):
    """A oneDNN-packed bf16 weight is offloaded (the handle dropped) and restored to the same
    dense values. oneDNN packs only on CPUs with avx512bw/vl/dq or avx_ne_convert: elsewhere the
    engine keeps dense weights, and this skips."""
    from pagedllm.kernels.onednn import pack_bf16_weight
    from pagedllm.models.layers import Linear
    from pagedllm.worker.sleep import offload, restore

    torch.manual_seed(0)
    dense = torch.randn(32, 64).bfloat16()
    packed = pack_bf16_weight(dense)
    if packed is None:
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU (needs avx512bw/vl/dq or avx_ne_convert)")
    monkeypatch.setenv("PAGEDLLM_SLEEP_DIR", str(tmp_path))
    m = torch.nn.Module()
    m.packed_lin = Linear(64, 32)
    m.packed_lin.onednn_weight = packed
    state = offload([m], 1)
    assert m.packed_lin.onednn_weight is None
    assert state.nbytes >= dense.numel() * 2
    restore(state)
    assert torch.equal(m.packed_lin.onednn_weight.to_dense(), dense)


# ------------------------------------------------------------------ server


def _args(**kw) -> argparse.Namespace:
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    args = make_arg_parser().parse_args([])
    args.api_key = None
    args.disable_log_requests = True
    args.disable_log_stats = True
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def sleepy_client(tiny_dir):
    from fastapi.testclient import TestClient

    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(EngineArgs(model=tiny_dir, enable_sleep_mode=True, kv_cache_memory="8MiB", dtype="float32"))
    app = build_app(engine, _args(enable_sleep_mode=True))
    with TestClient(app) as c:
        yield c
    engine.shutdown()


def test_server_sleep_routes(sleepy_client):
    c = sleepy_client
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    ref = c.post("/v1/completions", json=body)
    assert ref.status_code == 200
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}
    for level in (1, 2):
        assert c.post(f"/sleep?level={level}").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        metrics = c.get("/metrics").text
        assert 'pagedllm:sleep_level{model_name="' in metrics
        lv = [ln for ln in metrics.splitlines() if ln.startswith("pagedllm:sleep_level{")]
        assert float(lv[0].split()[-1]) == level
        bk = [ln for ln in metrics.splitlines() if ln.startswith("pagedllm:sleep_weights_backup_bytes{")]
        assert (float(bk[0].split()[-1]) > 0) == (level == 1)
        for path, payload in (("/v1/completions", body),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]})):
            r = c.post(path, json=payload)
            assert r.status_code == 503, (path, r.text)
            assert "sleeping" in r.json()["error"]["message"]
        assert c.post("/tokenize", json={"prompt": "w1 w2"}).status_code == 200  # needs no weights
        assert c.get("/v1/models").status_code == 200
        assert c.post("/wake_up?tags=weights").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        assert c.post("/wake_up").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        lv = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("pagedllm:sleep_level{")]
        assert float(lv[0].split()[-1]) == 0
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_server_sleep_bad_parameters(sleepy_client):
    c = sleepy_client
    r = c.post("/sleep?level=5")
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    r = c.post("/sleep?level=1&mode=wait")
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = c.post("/wake_up?tags=gpu")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert c.get("/is_sleeping").json() == {"is_sleeping": False}


def test_server_without_sleep_mode_has_no_sleep_routes():
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "entrypoints"))
    from fake_engine import FakeAsyncLLM

    with TestClient(build_app(FakeAsyncLLM(max_model_len=256), _args())) as c:
        for method, path in (("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping")):
            assert getattr(c, method)(path).status_code == 404


def test_serve_flag_parses():
    from pagedllm.entrypoints.openai.api_server import engine_args_from_namespace
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    args = make_arg_parser().parse_args(["--enable-sleep-mode"])
    assert args.enable_sleep_mode is True
    assert engine_args_from_namespace(args).enable_sleep_mode is True
    assert engine_args_from_namespace(make_arg_parser().parse_args([])).enable_sleep_mode is False


@pytest.mark.slow
def test_real_model_sleep_releases_weights_and_outputs_identical():
    """The default model (SmolLM2 Q4_1 GGUF blocks): asleep, anonymous resident memory drops by at
    least most of the weights (they are ~112 MB); greedy outputs after each wake equal the ones before."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.metrics.memory import anon_resident_bytes

    llm = LLM("SmolLM2-135M-Instruct", enable_sleep_mode=True, kv_cache_memory="64MiB", max_model_len=1024)
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The capital of France is", "Write one sentence about the sea."]
    ref = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    weights = llm.llm_engine.core.weight_bytes
    for level in (1, 2):
        llm.llm_engine.core.release_idle_memory()
        before = anon_resident_bytes()
        llm.sleep(level)
        asleep = anon_resident_bytes()
        assert before - asleep >= 0.7 * weights, (level, before, asleep, weights)
        llm.wake_up()
        assert [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)] == ref


def test_sleep_two_tensor_parallel_ranks(tiny_dir):
    """Both levels over two worker processes (``mp`` executor, tensor parallelism): every rank
    sleeps and wakes, greedy outputs unchanged."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(tiny_dir, enable_sleep_mode=True, kv_cache_memory="8MiB", dtype="float32", tensor_parallel_size=2)
    try:
        sp = SamplingParams(temperature=0, max_tokens=8)
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        for level in (1, 2):
            llm.sleep(level)
            assert llm.llm_engine.core.executor.collective_rpc("is_sleeping") == [["kv_cache", "weights"]] * 2
            llm.wake_up()
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref
    finally:
        llm.shutdown()
