"""``pagedllm serve MODEL --data-parallel-size N``: N engine replicas, one process each, behind the
router (``pagedllm.router.server.RouterApp``) on the server's one port.

The front process (this module's ``run_dp_serve``) binds the public port, starts N children
(``multiprocessing`` "spawn"), each a plain ``pagedllm serve`` of the same flags on a private
loopback port with ``data_parallel_rank`` r (``data_parallel_size`` stays N: the replicas split the
default KV cache memory and the cores, and their KV event endpoints are offset by rank, as vLLM's
are), waits until every child answers ``/v1/models``, and serves the router there:

* routing: ``--data-parallel-router`` (default ``prefix``: the replica whose prefix cache holds
  the longest prefix of the prompt, learnt from the replicas' KV cache events, which the front
  turns on over ``ipc://`` sockets in a private directory unless ``--kv-events-config`` already
  publishes them; else by load). ``off`` keeps the older in-process replicas
  (``pagedllm.engine.dp_async_llm``);
* every OpenAI / Anthropic / Ollama route and stream is forwarded byte for byte;
* ``/metrics``: the router's ``pagedllm_router_*`` families, then every replica's own metrics with
  the label ``engine="<rank>"`` added (vLLM's label for the engine index);
* ``/health``: 200 while every replica process is alive and healthy; 503 naming the replica once
  one has exited or fails its health check (the router keeps sending requests to the others);
* ``--data-parallel-backend ray``: each replica's ranks run as Ray actors on the cluster
  (``RAY_ADDRESS``), so the replicas spread over its nodes; a node that dies fails its replica's
  requests in flight (the engine reports the dead actor) and turns that replica's ``/health`` 503,
  which the router's health checks see, so later requests go to the others;
* SIGINT / SIGTERM: the front stops accepting, then every child gets SIGTERM (its own graceful
  shutdown), SIGKILL after ``_STOP_TIMEOUT_S``. A child whose parent dies exits too.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Optional
from pagedllm import envs

logger = logging.getLogger("pagedllm.router")

#: Seconds a replica gets to stop after SIGTERM before SIGKILL.
_STOP_TIMEOUT_S = 20.0
#: Seconds the front waits for every replica to load and answer ``/v1/models``.
_START_TIMEOUT_S = 3600.0
#: ``--data-parallel-router`` values: a router policy, or ``off`` (in-process replicas).
DP_ROUTER_CHOICES = ("prefix", "least-load", "round-robin", "sticky", "off")


def uses_router(args: argparse.Namespace) -> bool:
    """Whether ``pagedllm serve`` flags ask for replica processes behind the router: a
    ``--data-parallel-size`` > 1 in the front process, ``--data-parallel-router`` not ``off``."""
    return (int(getattr(args, "data_parallel_size", 1) or 1) > 1
            and getattr(args, "data_parallel_router", "prefix") != "off"
            and getattr(args, "dp_replica_rank", None) is None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _watch_parent(parent: int) -> None:
    """SIGTERM to this process once its parent is gone (the front was killed)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _replica_main(ns: argparse.Namespace, parent: int) -> None:
    """A child: ``pagedllm serve`` with this replica's rank and port (see the module docstring)."""
    threading.Thread(target=_watch_parent, args=(parent,), name="dp-parent-watch", daemon=True).start()
    if getattr(ns, "num_threads", None) is None and not (envs.is_set("PAGEDLLM_NUM_THREADS")
                                                        or os.environ.get("OMP_NUM_THREADS")):
        ns.num_threads = max(1, (os.cpu_count() or 1) // int(ns.data_parallel_size))
    from pagedllm.entrypoints.openai.api_server import run_server

    sys.exit(run_server(ns))


def _events_endpoints(args: argparse.Namespace, n: int, tmpdir: str) -> tuple[Optional[dict], list[str]]:
    """The children's ``kv_events_config`` and the router's N endpoints to subscribe to."""
    from pagedllm.kv_events import offset_endpoint_port

    cfg = getattr(args, "kv_events_config", None)
    if isinstance(cfg, dict) and cfg.get("enable_kv_cache_events") and cfg.get("endpoint") \
            and cfg.get("publisher", "zmq") == "zmq":
        base = str(cfg["endpoint"])
        eps = [str(offset_endpoint_port(base, r)) for r in range(n)]
        eps = [e.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:") for e in eps]
        return cfg, eps
    new = dict(cfg or {}, enable_kv_cache_events=True, publisher="zmq",
               endpoint=f"ipc://{os.path.join(tmpdir, 'kv')}")
    new.pop("replay_endpoint", None)
    return new, [str(offset_endpoint_port(new["endpoint"], r)) for r in range(n)]


class _Children:
    """The replica processes, their URLs, and their stop."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.urls: list[str] = []

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every replica that has exited."""
        return [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]

    def stop(self) -> None:
        for p in self.procs:
            if p.exitcode is None and p.pid:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5)


def _wait_ready(children: _Children, timeout_s: float) -> None:
    """Until every replica answers ``/v1/models`` 200.

    Raises:
        RuntimeError: a replica exited first, or the timeout passed (naming it).
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = set(range(len(children.urls)))
    while pending:
        for r, code in children.dead():
            raise RuntimeError(f"data-parallel replica {r} exited with code {code} during start-up "
                               "(see its log above)")
        for r in sorted(pending):
            try:
                if httpx.get(children.urls[r] + "/v1/models", timeout=2.0).status_code == 200:
                    pending.discard(r)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"data-parallel replica {min(pending)} did not start in {timeout_s:.0f} s")
        if pending:
            time.sleep(0.3)


def merge_replica_metrics(texts: list[Optional[str]]) -> bytes:
    """Replicas' Prometheus text expositions as one, each sample labelled ``engine="<rank>"``.

    Args:
        texts: replica r's ``/metrics`` body, or None (unreachable: left out).

    Returns:
        The merged exposition (text format 0.0.4), one HELP/TYPE per family.
    """
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for rank, text in enumerate(texts):
        if not text:
            continue
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.samples.append(s._replace(labels={**s.labels, "engine": str(rank)}))

    class _Fixed:
        def collect(self):
            return list(merged.values())

    return generate_latest(_Fixed())  # type: ignore[arg-type]


def run_dp_serve(args: argparse.Namespace, sock: socket.socket) -> int:
    """``pagedllm serve --data-parallel-size N`` through the router (the module docstring).

    Args:
        args: the parsed ``pagedllm serve`` flags (``data_parallel_size`` > 1).
        sock: the bound public listening socket (``preflight.prepare_serve``).

    Returns:
        0 after a requested shutdown; 1 when a replica failed to start (its log is above).
    """
    import multiprocessing as mp

    import uvicorn

    from pagedllm.router.policy import PolicyConfig
    from pagedllm.router.server import RouterApp, load_router_tokenizer, probe_replicas

    n = int(args.data_parallel_size)
    policy = getattr(args, "data_parallel_router", None) or "prefix"
    host = getattr(args, "host", None) or "127.0.0.1"
    port = int(getattr(args, "port", 8000))
    tmpdir = tempfile.mkdtemp(prefix="pagedllm-dp-")
    kv_cfg, endpoints = _events_endpoints(args, n, tmpdir) if policy == "prefix" else (None, [])
    ctx = mp.get_context("spawn")
    children = _Children()
    try:
        for r in range(n):
            ns = copy.copy(args)
            ns.dp_replica_rank = r
            ns.data_parallel_rank = r
            ns.host, ns.port = "127.0.0.1", _free_port()
            if kv_cfg is not None:
                ns.kv_events_config = kv_cfg
            p = ctx.Process(target=_replica_main, args=(ns, os.getpid()), name=f"pagedllm-dp{r}")
            p.start()
            children.procs.append(p)
            children.urls.append(f"http://127.0.0.1:{ns.port}")
        _wait_ready(children, _START_TIMEOUT_S)
        tokenizer = chat_template = None
        if policy == "prefix":
            try:
                tokenizer = load_router_tokenizer(getattr(args, "tokenizer", None),
                                                  probe_replicas(children.urls[:1]))
            except ValueError as e:  # e.g. a tokenizer only the engine's loader reads
                logger.warning("pagedllm serve: prefix routing off, routing by load (%s)", e)
                policy, endpoints = "least-load", []
            if getattr(args, "chat_template", None):
                from pagedllm.engine.chat import load_chat_template
                chat_template = load_chat_template(args.chat_template)
        ra = RouterApp(children.urls, policy, kv_endpoints=endpoints or None, tokenizer=tokenizer,
                       chat_template=chat_template, health_check_interval=1.0, policy_config=PolicyConfig())
    except (RuntimeError, ValueError) as e:
        print(f"pagedllm serve: error: {e}", file=sys.stderr, flush=True)
        sock.close()
        children.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
        return 1
    ra.replica_processes = children  # type: ignore[attr-defined]
    _add_dp_routes(ra, children)
    print(f"pagedllm: serving {n} data-parallel replicas on http://{host}:{port} (router policy {policy}; "
          f"replicas {', '.join(children.urls)})", flush=True)
    config = uvicorn.Config(ra.app, host=host, port=port,
                            log_level=getattr(args, "uvicorn_log_level", "info") or "info",
                            timeout_keep_alive=5, timeout_graceful_shutdown=10)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT / SIGTERM: a requested stop is exit status 0
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        children.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
    print("pagedllm: server stopped", flush=True)
    return 0


def _add_dp_routes(ra: Any, children: _Children) -> None:
    """``/health`` and ``/metrics`` of the data-parallel front, ahead of the router's own."""
    import asyncio

    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def problems() -> list[str]:
        out = [f"data-parallel replica {r} ({children.urls[r]}) exited with code {code}"
               for r, code in children.dead()]
        dead = {r for r, _ in children.dead()}
        out += [f"data-parallel replica {rep.index} ({rep.url}) is unhealthy: {rep.last_error}"
                for rep in ra.replicas if not rep.healthy and rep.index not in dead]
        return out

    async def health(request: Any) -> Response:
        bad = problems()
        if bad:
            return JSONResponse({"error": {"message": "; ".join(bad), "type": "ServiceUnavailableError",
                                           "param": None, "code": 503}}, status_code=503)
        return Response(status_code=200)

    async def metrics(request: Any) -> Response:
        import httpx

        async def one(url: str) -> Optional[str]:
            try:
                r = await ra._client.get(url + "/metrics", timeout=5.0)
                return r.text if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        texts = await asyncio.gather(*(one(u) for u in children.urls))
        body = ra.render_metrics() + merge_replica_metrics(list(texts))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    ra.app.router.routes[:0] = [Route("/health", health, methods=["GET"]),
                                Route("/metrics", metrics, methods=["GET"])]


__all__ = ["DP_ROUTER_CHOICES", "merge_replica_metrics", "run_dp_serve", "uses_router"]
