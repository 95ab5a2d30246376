"""AsyncLLM (the server's engine front end) on the real SmolLM2: the engine is built and stepped
on one thread that is not the caller's, construction errors reach the caller, and a streamed
greedy request equals the offline one."""
from __future__ import annotations

import asyncio
import threading

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.llm_engine import LLMEngine

MODEL = "SmolLM2-135M-Instruct"
KW = dict(num_threads=1, kv_cache_memory="64MiB", max_model_len=256)


def test_engine_built_and_stepped_on_one_thread(monkeypatch):
    """One thread holds all of the engine's torch work (OpenMP gives each thread its own worker
    team; two teams on two cores made every step ~40% slower,
    benchmarks/results/performance-history-2026-11.md step 24)."""
    seen: dict = {"init": set(), "step": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def record_init(self, *a, **k):
        seen["init"].add(threading.get_ident())
        init(self, *a, **k)

    def record_step(self, *a, **k):
        seen["step"].add(threading.get_ident())
        return step(self, *a, **k)

    monkeypatch.setattr(LLMEngine, "__init__", record_init)
    monkeypatch.setattr(LLMEngine, "step", record_step)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, **KW))
    sp = SamplingParams(temperature=0.0, max_tokens=6)

    async def run():
        final = None
        async for out in engine.generate("The capital of France is", sp, "r1"):
            final = out
        return final

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(seen["init"]) == 1 and seen["init"] == seen["step"]
    assert threading.get_ident() not in seen["init"]
    monkeypatch.undo()
    offline = LLM(MODEL, **KW).generate(["The capital of France is"], sp, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].token_ids == offline.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6


def test_construction_error_reaches_the_caller():
    def engine_threads() -> int:
        return sum(t.name == "pagedllm-engine" and t.is_alive() for t in threading.enumerate())

    before = engine_threads()
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncLLM.from_engine_args(EngineArgs(model=MODEL, max_num_seqs=0, **KW))
    assert engine_threads() == before  # the failed build's thread has ended


def test_shutdown_before_any_request_stops_the_thread():
    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, **KW))
    assert engine._thread.is_alive()  # built, waiting for the first request's event loop
    engine.shutdown()
    assert not engine._thread.is_alive()


def test_duplicate_request_id_fails_alone():
    """Two concurrent requests with one id: the second is refused (ValueError) and nothing else
    is touched; an add the engine refuses reaches only that request's queue."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, **KW))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def collect(gen):
        final = None
        async for out in gen:
            final = out
        return final

    async def run():
        other = asyncio.ensure_future(collect(engine.generate("Once upon a time", sp, "other")))
        first = asyncio.ensure_future(collect(engine.generate("Hello there", sp, "dup")))
        await asyncio.sleep(0)  # both have started
        second = asyncio.ensure_future(collect(engine.generate("General Kenobi", sp, "dup")))
        results = await asyncio.gather(other, first, second, return_exceptions=True)
        # white box: the engine thread refuses an id it already holds; only that queue hears it
        held = asyncio.ensure_future(collect(engine.generate("The sky is", sp, "held")))
        await asyncio.sleep(0)
        q = engine._add(engine.engine.process_inputs("held", "Another prompt", sp, strict_length=True))
        refused = await q.get()
        return results, await held, refused

    try:
        (other, first, second), held, refused = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(second, ValueError) and "already in use" in str(second)
    assert other.finished and len(other.outputs[0].token_ids) == 12
    assert first.finished and len(first.outputs[0].token_ids) == 12
    assert held.finished and len(held.outputs[0].token_ids) == 12
    assert isinstance(refused, ValueError) and "already" in str(refused), refused
    offline = LLM(MODEL, **KW).generate(["Once upon a time", "Hello there"], sp, use_tqdm=False)
    assert other.outputs[0].token_ids == offline[0].outputs[0].token_ids
    assert first.outputs[0].token_ids == offline[1].outputs[0].token_ids


def test_takes_the_engine_core_request_the_server_builds():
    """The server builds an EngineCoreRequest with the engine's input processor and hands it to
    generate (an EngineClient's); it runs as the same raw prompt does, and a mismatched id or a
    pooling request is refused."""
    from pagedllm.engine.protocol import EngineClient, missing_members
    from pagedllm.pooling_params import PoolingParams

    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, **KW))
    assert isinstance(engine, EngineClient) and missing_members(engine) == []
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = "The capital of France is"

    async def collect(gen):
        final = None
        async for out in gen:
            final = out
        return final

    async def run():
        req = engine.input_processor.process_inputs("built", prompt, sp, strict_length=True)
        assert req.sampling_params.max_tokens == 6 and req.sampling_params is not sp and req.prompt == prompt
        built = await collect(engine.generate(req, sp, "built"))
        raw = await collect(engine.generate(prompt, sp, "raw"))
        with pytest.raises(ValueError, match="does not match"):
            await collect(engine.generate(req, sp, "another"))
        with pytest.raises(ValueError, match="not a pooling model"):
            engine.input_processor.process_inputs("p", prompt, PoolingParams(), task="embed")
        return built, raw

    try:
        built, raw = asyncio.run(run())
    finally:
        engine.shutdown()
    assert built.request_id == "built" and built.prompt == prompt
    assert built.outputs[0].token_ids == raw.outputs[0].token_ids and len(raw.outputs[0].token_ids) == 6
    assert built.prompt_token_ids == raw.prompt_token_ids
