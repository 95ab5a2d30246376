"""``pagedllm serve`` with data parallelism and with a tensor-parallel rank killed mid-request
(tiny random checkpoint; the server and its worker processes are stopped at teardown)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

PROMPTS = [" ".join(f"w{(7 * i + 3 * j) % 250 + 3}" for j in range(5 + i % 7)) for i in range(32)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, *flags: str):
    port = _free_port()
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
         "--dtype", "float32", "--kv-cache-memory", str(8 * 1024**2), "--disable-log-stats", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            time.sleep(0.5)
    _stop(proc)
    raise RuntimeError("server did not start")


def _stop(proc) -> None:
    """Stop the server and every worker process under it."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for k in kids:
        try:
            k.wait(10)
        except psutil.TimeoutExpired:
            k.kill()
        except psutil.NoSuchProcess:
            pass
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE], "workers left running"


@pytest.fixture
def server_factory():
    started = []

    def start(model, *flags):
        base, proc = _start(model, *flags)
        started.append(proc)
        return base, proc

    yield start
    for proc in started:
        _stop(proc)


async def _complete_all(base: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        async def one(p):
            r = await c.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        return await asyncio.gather(*(one(p) for p in prompts))


def test_data_parallel_two_replicas(server_factory, tiny_llama_dir):
    from pagedllm import LLM, SamplingParams

    ref_llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 * 1024**2)
    ref = [o.outputs[0].text for o in ref_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    base, _ = server_factory(tiny_llama_dir, "--data-parallel-size", "2", "--served-model-name", "m")
    got = asyncio.run(_complete_all(base, PROMPTS, 8))
    assert got == ref
    metrics = httpx.get(base + "/metrics").text
    done = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'pagedllm:request_success_total\{engine="(\d)",finished_reason="length",model_name="m"\} ([0-9.]+)', metrics)}
    assert set(done) == {"0", "1"} and all(v > 0 for v in done.values()) and sum(done.values()) == 32, done


def test_killed_rank_fails_requests_and_health(server_factory, tiny_llama_dir):
    base, proc = server_factory(tiny_llama_dir, "--tensor-parallel-size", "2", "--served-model-name", "m",
                                "--max-model-len", "512")
    workers = [k for k in psutil.Process(proc.pid).children(recursive=True)
               if "pagedllm.executor.multiproc_executor" in " ".join(k.cmdline())]
    assert len(workers) == 2
    rank1 = next(k for k in workers if k.cmdline()[-1] == "1")

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            body = {"model": "m", "prompt": "w5 w6 w7", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
            plain = asyncio.create_task(c.post("/v1/completions", json=body))
            lines = []
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                t0 = None
                async for line in s.aiter_lines():
                    lines.append(line)
                    if t0 is None and line.startswith("data: {"):
                        t0 = time.monotonic()
                        rank1.kill()  # mid-request: both requests are being decoded
            stream_secs = time.monotonic() - t0
            r = await plain
            return r, lines, stream_secs

    r, lines, secs = asyncio.run(scenario())
    assert r.status_code >= 500 and "rank 1" in r.text, (r.status_code, r.text)
    assert secs < 10, secs
    assert any("error" in ln and "rank 1" in ln for ln in lines), lines[-3:]
    assert not any('"finish_reason":"length"' in ln.replace(" ", "") for ln in lines)
    h = httpx.get(base + "/health")
    assert h.status_code == 503 and "rank 1" in h.text, h.text
