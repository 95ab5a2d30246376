"""AsyncLLM with structured outputs on SmolLM2: a constraint no backend compiles raises before any
output and frees the request id; a client that goes away while its grammar compiles does not
cancel the compile other requests share; constrained and free requests run side by side."""
from __future__ import annotations

import asyncio
import re
import threading

import pytest

from pagedllm import SamplingParams, StructuredOutputsParams as SOP
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def loop():
    # NOTE: one event loop for the module: an AsyncLLM delivers outputs to the loop it first saw.
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(loop):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, num_threads=1, kv_cache_memory="64MiB",
                                               max_model_len=256, dtype="float32"))
    yield eng
    eng.shutdown()


async def _final(engine, prompt, sp, rid):
    out = None
    async for o in engine.generate(prompt, sp, rid):
        out = o
    return out


def test_bad_constraint_raises_before_output_and_frees_the_id(engine, loop):
    sp = SamplingParams(max_tokens=4, structured_outputs=SOP(regex="(?<=a)b"))

    async def run():
        with pytest.raises(ValueError, match=r"structured_outputs.regex: .*Lookbehind"):
            await _final(engine, "hi", sp, "bad")
        # The id is free again and the engine serves the next request.
        ok = SamplingParams(max_tokens=4, structured_outputs=SOP(choice=["fine"]))
        return await _final(engine, "hi", ok, "bad")
    out = loop.run_until_complete(run())
    assert out.outputs[0].text == "fine" and out.finished


def test_cancelled_waiter_does_not_cancel_the_shared_compile(engine, loop, monkeypatch):
    mgr = engine.engine.core.structured_output_manager
    gate = threading.Event()
    real = type(mgr)._compile

    def slow_compile(self, backend, spec):
        assert gate.wait(60)
        return real(self, backend, spec)
    monkeypatch.setattr(type(mgr), "_compile", slow_compile)
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SOP(regex=r"[0-9]{3}"))

    async def run():
        # Two other compiles hold both compile threads, so this constraint's compile is queued
        # (a queued future is the kind a cancellation would cancel).
        busy = [mgr.grammar_future(SOP(regex=f"busy{i}")) for i in range(mgr.config.compile_threads)]
        stays = asyncio.ensure_future(_final(engine, "A number: ", sp, "stays"))
        gone = asyncio.ensure_future(_final(engine, "A number: ", sp, "gone"))
        await asyncio.sleep(0.5)
        shared = mgr.grammar_future(sp.structured_outputs, count=False)
        assert not shared.running() and not shared.done()
        gone.cancel()  # a client disconnects while the grammar it shares waits to compile
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not shared.cancelled()
        gate.set()
        for f in busy:
            f.result(60)
        return await asyncio.wait_for(stays, 600)
    out = loop.run_until_complete(run())
    assert re.fullmatch(r"[0-9]{3}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_constrained_and_free_side_by_side(engine, loop):
    free = SamplingParams(temperature=0.0, max_tokens=12)
    cons = SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=SOP(choice=["red", "blue"]))

    async def run():
        return await asyncio.gather(*[
            _final(engine, f"Say something about {i}.", cons if i % 2 else free, f"mix{i}") for i in range(6)])
    outs = loop.run_until_complete(run())
    alone = loop.run_until_complete(_final(engine, "Say something about 0.", free, "alone"))
    for i, o in enumerate(outs):
        if i % 2:
            assert o.outputs[0].text in ("red", "blue")
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
