"""Start and stop ``pagedllm serve`` subprocesses for the real-server tests."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Any, Awaitable, Callable, Iterator, Optional

import httpx


def run_in_process(make_app: Callable[[], Any], body: Callable[[httpx.AsyncClient], Awaitable[Any]],
                   finally_: Optional[Callable[[], Any]] = None) -> Any:
    """``await body(client)`` against the ASGI app ``make_app()`` (built inside the event loop)
    in this process, no server: an ``httpx.AsyncClient`` on ``http://test`` with a 60 s timeout,
    on a fresh event loop; ``finally_()`` afterwards (e.g. ``engine.shutdown``). Returns what
    ``body`` returns."""
    import asyncio

    async def main() -> Any:
        transport = httpx.ASGITransport(app=make_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await body(client)

    try:
        return asyncio.run(main())
    finally:
        if finally_ is not None:
            finally_()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_status(url: str, status: int, timeout: float, interval: float = 0.2) -> httpx.Response:
    """GET ``url`` until it answers ``status`` or ``timeout`` seconds pass; returns the last response
    (the caller asserts on it, so a timeout shows what was answered instead)."""
    deadline = time.time() + timeout
    while True:
        r = httpx.get(url, timeout=10)
        if r.status_code == status or time.time() > deadline:
            return r
        time.sleep(interval)


@contextlib.contextmanager
def serve(args: list[str], *, env_drop: tuple[str, ...] = (), timeout: float = 180.0,
          stop_timeout: float = 30.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m pagedllm.entrypoints.cli serve *args --port PORT`` with one engine thread.

    Args:
        args: the model and flags after ``serve`` (no ``--port``).
        env_drop: environment variables to remove for the server.
        timeout: seconds to wait for ``/health`` to answer 200.
        stop_timeout: seconds to wait after SIGTERM before killing the server.

    Yields:
        (base URL ``http://127.0.0.1:PORT``, the server process) once ``/health`` answers.

    Raises:
        RuntimeError: the server exited (its output in the message) or did not answer in time.
    """
    port = free_port()
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    for name in env_drop:
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args, "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.3)
    try:
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
