"""``pagedllm router``: one OpenAI / Anthropic / Ollama-compatible front over ``pagedllm serve``
(or vLLM) replicas, forwarding requests and streaming their bytes unchanged.

Routing (``pagedllm.router.policy``): ``prefix`` sends a request to the replica whose prefix cache
holds the longest prefix of its prompt, learnt from the replicas' own KV cache events
(``--kv-events-endpoint``, one per replica: what the replica's ``--kv-events-config`` endpoint
binds, e.g. ``tcp://host:5557``; ``pagedllm.router.index``), falling back to the fewest requests in
flight; ``least-load``, ``round-robin`` and ``sticky`` need no events. The prompt is rendered and
tokenized here as the replica does it (``pagedllm.engine.chat.render_chat`` and the model's
tokenizer, loaded from the path the replicas' ``/v1/models`` report as ``root`` or from
``--tokenizer``); the block size is the one the replica's events carry.

Failures: every ``--health-check-interval`` seconds ``GET /health`` on each replica; a replica
that fails it, or refuses a connection, gets no new requests until it passes again (its index
entries are dropped). A request whose connection was refused (it never started) is retried on
another replica; one whose replica dies after it started gets an error: a 502 OpenAI error body,
or in a stream a last error event (``data: {"error": {...}}`` then ``data: [DONE]`` for
OpenAI, ``event: error`` for Anthropic, ``{"error": ...}`` for Ollama's NDJSON). Draining:
``POST /router/drain {"replica": URL}`` stops new requests to it (``/router/undrain`` undoes);
``GET /router/replicas`` shows each replica's state and requests in flight.

Every response carries ``x-pagedllm-replica: URL`` (the replica that served it). ``/metrics``:
``pagedllm_router_*`` counters per replica and the prefix index's size against its bound
(``--max-index-blocks``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request  # NOTE: module level: FastAPI resolves the handlers' annotations here

from pagedllm.router.index import PrefixIndex, chain_hashes
from pagedllm.router.policy import POLICIES, PolicyConfig, Router

logger = logging.getLogger("pagedllm.router")

#: Request headers not forwarded (hop-by-hop, or set by the HTTP client).
_DROP_REQ = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive",
             "upgrade", "te"}
#: Response headers not copied back (the router's server sets its own framing).
_DROP_RESP = {"content-length", "connection", "transfer-encoding", "content-encoding", "keep-alive", "date",
              "server"}
#: Paths the router answers itself.
OWN_PATHS = ("/health", "/metrics", "/router/replicas", "/router/drain", "/router/undrain")


def check_replica_url(url: str) -> str:
    """``url`` without a trailing slash.

    Raises:
        ValueError: not ``http(s)://host[:port]`` (optionally with a path), naming it.
    """
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--replica: {url!r} is not an http(s)://HOST:PORT URL")
    try:
        _ = u.port
    except ValueError:
        raise ValueError(f"--replica: {url!r} has a bad port") from None
    if u.query or u.fragment:
        raise ValueError(f"--replica: {url!r} has a query or fragment")
    return url.rstrip("/")


@dataclass
class Replica:
    """One upstream server and the router's view of it."""

    index: int
    url: str
    kv_endpoint: Optional[str] = None
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    last_error: Optional[str] = None
    last_seq: Optional[int] = None
    kv_events: int = 0
    kv_gaps: int = 0


def _anthropic_to_messages(body: dict) -> list[dict]:
    """An Anthropic ``/v1/messages`` body as OpenAI chat messages (text parts only)."""

    def text(c: Any) -> str:
        if isinstance(c, str):
            return c
        if isinstance(c, list):
            return "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
        return ""

    out: list[dict] = []
    if body.get("system"):
        out.append({"role": "system", "content": text(body["system"])})
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            out.append({"role": m.get("role"), "content": text(m.get("content"))})
    return out


class RouterApp:
    """The router's state and its FastAPI app (``.app``).

    Args:
        replicas: replica base URLs (checked with ``check_replica_url``).
        policy: one of ``pagedllm.router.policy.POLICIES``.
        kv_endpoints: one ZMQ endpoint per replica for its KV events (prefix policy), or None.
        tokenizer: a tokenizer (``encode``, ``apply_chat_template``) for the prefix policy.
        chat_template: the replicas' ``--chat-template`` (text), if they use one.
        max_index_blocks: bound of the prefix index.
        health_check_interval: seconds between health checks.
        policy_config: the prefix policy's thresholds.

    Raises:
        ValueError: a bad URL or policy, or kv_endpoints of the wrong length.
    """

    def __init__(self, replicas: list[str], policy: str = "least-load", *,
                 kv_endpoints: Optional[list[str]] = None, tokenizer: Any = None,
                 chat_template: Optional[str] = None, max_index_blocks: int = 1_000_000,
                 health_check_interval: float = 2.0, policy_config: Optional[PolicyConfig] = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy: expected one of {list(POLICIES)}, got {policy!r}")
        if kv_endpoints is not None and len(kv_endpoints) != len(replicas):
            raise ValueError(f"--kv-events-endpoint: give one per --replica ({len(replicas)}), "
                             f"got {len(kv_endpoints)}")
        self.replicas = [Replica(i, check_replica_url(u), (kv_endpoints or [None] * len(replicas))[i])
                         for i, u in enumerate(replicas)]
        self.policy = policy
        self.router = Router(policy, policy_config)
        self.index = PrefixIndex(max_index_blocks)
        self.tokenizer = tokenizer
        from pagedllm.router.tokens import SegmentTokenizer
        self.segments = SegmentTokenizer(tokenizer) if tokenizer is not None else None
        self.chat_template = chat_template
        self.health_check_interval = health_check_interval
        self._stop = threading.Event()
        self._sub_thread: Optional[threading.Thread] = None
        self._client: Any = None
        from pagedllm.router.upstream import UpstreamPool
        self._pools = [UpstreamPool(r.url) for r in self.replicas]
        self._init_metrics()
        self.app = self._build_app()

    # ----------------------------------------------------------------------------------- metrics
    def _init_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "pagedllm_router_"
        lab = ["replica"]
        self.m_requests = Counter(p + "requests", "Requests forwarded, by replica and HTTP status "
                                  "(\"error\": the replica failed after the request started).",
                                  lab + ["code"], registry=r)
        self.m_decisions = Counter(p + "routing_decisions", "Routing decisions by replica and reason "
                                   "(prefix, load, round-robin, sticky).", lab + ["reason"], registry=r)
        self.m_retries = Counter(p + "retries", "Requests retried elsewhere because this replica refused "
                                 "the connection (they never started).", lab, registry=r)
        self.m_stream_errors = Counter(p + "stream_errors", "Responses cut off because the replica failed "
                                       "after they started.", lab, registry=r)
        self.m_prompt_blocks = Counter(p + "prompt_blocks", "Full prompt blocks of the requests routed "
                                       "(prefix policy).", lab, registry=r)
        self.m_matched_blocks = Counter(p + "matched_blocks", "Of those, blocks the index said the "
                                        "chosen replica held.", lab, registry=r)
        self.m_kv_events = Counter(p + "kv_event_batches", "KV event batches received.", lab, registry=r)
        self.m_kv_gaps = Counter(p + "kv_event_gaps", "Gaps in a replica's event sequence (its index "
                                 "entries are dropped).", lab, registry=r)
        self.m_in_flight = Gauge(p + "requests_in_flight", "Requests forwarded and not finished.", lab,
                                 registry=r)
        self.m_healthy = Gauge(p + "replica_healthy", "1 while the replica passes health checks.", lab,
                               registry=r)
        self.m_draining = Gauge(p + "replica_draining", "1 while the replica is draining.", lab, registry=r)
        self.m_replica_blocks = Gauge(p + "prefix_index_replica_blocks", "Blocks of the replica in the "
                                      "prefix index.", lab, registry=r)
        self.m_index_blocks = Gauge(p + "prefix_index_blocks", "Distinct blocks in the prefix index.",
                                    registry=r)
        self.m_index_capacity = Gauge(p + "prefix_index_capacity_blocks", "Most blocks the prefix index "
                                      "keeps (--max-index-blocks); beyond it the least recently used go.",
                                      registry=r)
        self.m_index_evicted = Gauge(p + "prefix_index_evicted_blocks_total", "Blocks dropped from the "
                                     "prefix index at its bound.", registry=r)
        self.m_tok_entries = Gauge(p + "token_cache_entries", "Prompt text pieces whose token ids the router "
                                   "keeps (prefix policy).", registry=r)
        self.m_tok_capacity = Gauge(p + "token_cache_capacity_entries", "Most pieces kept; beyond it the least "
                                    "recently used go.", registry=r)
        self.m_tok_hits = Gauge(p + "token_cache_hits_total", "Prompt pieces found in the cache.", registry=r)
        self.m_tok_misses = Gauge(p + "token_cache_misses_total", "Prompt pieces tokenized.", registry=r)
        self.m_tok_evicted = Gauge(p + "token_cache_evicted_total", "Pieces dropped at the bound.", registry=r)
        self.m_overhead = Histogram(p + "routing_seconds", "Time from a request's arrival to its upstream "
                                    "send (body parse, tokenize, hash, choose).", registry=r,
                                    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1))

    def render_metrics(self) -> bytes:
        """The Prometheus text exposition of the router's metrics."""
        from prometheus_client import generate_latest

        for rep in self.replicas:
            self.m_in_flight.labels(rep.url).set(rep.in_flight)
            self.m_healthy.labels(rep.url).set(1 if rep.healthy else 0)
            self.m_draining.labels(rep.url).set(1 if rep.draining else 0)
            self.m_replica_blocks.labels(rep.url).set(self.index.replica_blocks(rep.index))
        st = self.index.stats()
        self.m_index_blocks.set(st["blocks"])
        self.m_index_capacity.set(st["capacity"])
        self.m_index_evicted.set(st["evicted"] + st["ext_evicted"])
        if self.segments is not None:
            ts = self.segments.stats()
            self.m_tok_entries.set(ts["entries"])
            self.m_tok_capacity.set(ts["capacity"])
            self.m_tok_hits.set(ts["hits"])
            self.m_tok_misses.set(ts["misses"])
            self.m_tok_evicted.set(ts["evicted"])
        return generate_latest(self.registry)

    # ------------------------------------------------------------------------------- KV events
    def handle_kv_batch(self, replica: int, seq: int, payload: bytes) -> None:
        """Apply one KV event message (``[topic, seq, payload]``, ``pagedllm.kv_events``'s wire
        format) of ``replica`` to the index; a gap in ``seq`` drops the replica's entries."""
        import msgspec

        rep = self.replicas[replica]
        if rep.last_seq is not None and seq != rep.last_seq + 1:
            rep.kv_gaps += 1
            self.m_kv_gaps.labels(rep.url).inc()
            self.index.clear_replica(replica)
        rep.last_seq = seq
        rep.kv_events += 1
        self.m_kv_events.labels(rep.url).inc()
        batch = msgspec.msgpack.decode(payload)
        for ev in batch[1]:
            kind = ev.get("type")
            if kind == "BlockStored":
                self.index.block_stored(replica, ev["block_hashes"], ev.get("parent_block_hash"),
                                        ev["token_ids"], ev["block_size"], ev.get("lora_id"))
            elif kind == "BlockRemoved":
                self.index.block_removed(replica, ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.index.clear_replica(replica)

    def _subscribe_loop(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        poller = zmq.Poller()
        socks = {}
        for rep in self.replicas:
            if rep.kv_endpoint:
                s = ctx.socket(zmq.SUB)
                s.connect(rep.kv_endpoint)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                poller.register(s, zmq.POLLIN)
                socks[s] = rep.index
        try:
            while not self._stop.is_set():
                for s, _ in poller.poll(100):
                    frames = s.recv_multipart()
                    if len(frames) != 3:
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq < 0:  # the publisher's end marker
                        continue
                    try:
                        self.handle_kv_batch(socks[s], seq, frames[2])
                    except Exception:
                        logger.exception("pagedllm router: bad KV event batch from %s",
                                         self.replicas[socks[s]].url)
        finally:
            for s in socks:
                s.close(linger=0)

    # ---------------------------------------------------------------------------------- health
    def mark_down(self, rep: Replica, why: str) -> None:
        """Stop routing to ``rep`` until a health check passes (its index entries are dropped)."""
        if rep.healthy:
            logger.warning("pagedllm router: replica %s is down (%s)", rep.url, why)
        rep.healthy = False
        rep.last_error = why
        self.index.clear_replica(rep.index)

    async def check_health(self) -> None:
        """One ``GET /health`` round over every replica."""
        import httpx

        async def one(rep: Replica) -> None:
            try:
                r = await self._client.get(rep.url + "/health", timeout=2.0)
                ok, why = r.status_code == 200, f"/health answered {r.status_code}"
            except httpx.HTTPError as e:
                ok, why = False, f"{type(e).__name__}: {e}"
            if ok and not rep.healthy:
                logger.warning("pagedllm router: replica %s is back", rep.url)
                rep.last_seq = None
            if ok:
                rep.healthy = True
            else:
                self.mark_down(rep, why)

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval)
            try:
                await self.check_health()
            except Exception:
                logger.exception("pagedllm router: health check failed")

    # ---------------------------------------------------------------------------------- prompt
    def prompt_tokens(self, path: str, body: Any) -> Optional[list[int]]:
        """The prompt token ids the replica will compute for this request (prefix policy), or
        None when unknown (no tokenizer, an unrendered route, a body the replica will reject)."""
        tok = self.tokenizer
        if tok is None or not isinstance(body, dict):
            return None
        try:
            messages = None
            if path in ("/v1/chat/completions", "/api/chat"):
                messages = body.get("messages")
            elif path == "/v1/messages":
                messages = _anthropic_to_messages(body)
            if messages is not None:
                from pagedllm.engine.chat import render_chat

                text = render_chat(tok, messages, chat_template=body.get("chat_template") or self.chat_template,
                                   add_generation_prompt=body.get("add_generation_prompt", True),
                                   continue_final_message=body.get("continue_final_message", False),
                                   chat_template_kwargs=body.get("chat_template_kwargs"),
                                   tools=body.get("tools") or None)
                add = bool(body.get("add_special_tokens", False))
                if self.segments is not None:
                    return self.segments.encode(text, add)
                return list(tok.encode(text, add_special_tokens=add))
            if path in ("/v1/completions", "/v1/embeddings"):
                p = body.get("prompt") if path == "/v1/completions" else body.get("input")
                if isinstance(p, list) and p and isinstance(p[0], (str, list)):
                    p = p[0]  # a batch: route by its first prompt
                if isinstance(p, list) and all(isinstance(t, int) for t in p):
                    return p
                if isinstance(p, str):
                    return list(tok.encode(p, add_special_tokens=bool(body.get("add_special_tokens", True))))
        except Exception:
            logger.debug("pagedllm router: cannot tokenize the prompt", exc_info=True)
        return None

    # ------------------------------------------------------------------------------- forwarding
    def eligible(self, exclude: set[int]) -> list[int]:
        """Replicas that may get a new request: healthy, not draining, not in ``exclude``."""
        return [r.index for r in self.replicas if r.healthy and not r.draining and r.index not in exclude]

    def _choose(self, path: str, body: Any, headers: Any, exclude: set[int]):
        eligible = self.eligible(exclude)
        if not eligible:
            return None
        matches: dict[int, int] = {}
        nblocks = 0
        if self.policy == "prefix":
            toks = self.prompt_tokens(path, body)
            if toks:
                sizes = {self.index.block_size.get(i) for i in eligible} - {None}
                for bs in sizes:
                    hashes = chain_hashes(toks, bs)
                    nblocks = max(nblocks, len(hashes))
                    for i, d in self.index.match(hashes).items():
                        if self.index.block_size.get(i) == bs:
                            matches[i] = d
        session = headers.get("x-session-id") or (body.get("user") if isinstance(body, dict) else None)
        dec = self.router.choose(eligible, [r.in_flight for r in self.replicas], matches=matches,
                                 prompt_blocks=nblocks, session=session if isinstance(session, str) else None)
        rep = self.replicas[dec.replica]
        self.m_decisions.labels(rep.url, dec.reason).inc()
        if nblocks:
            self.m_prompt_blocks.labels(rep.url).inc(nblocks)
            self.m_matched_blocks.labels(rep.url).inc(matches.get(dec.replica, 0))
        return rep

    @staticmethod
    def _error_chunk(content_type: str, path: str, message: str) -> bytes:
        err = {"message": message, "type": "InternalServerError", "param": None, "code": 502}
        if "ndjson" in content_type:
            return (json.dumps({"error": message}) + "\n").encode()
        if path == "/v1/messages":
            body = {"type": "error", "error": {"type": "api_error", "message": message}}
            return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
        return f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode()

    async def forward(self, request: Request) -> Any:
        """Forward one request (see the module docstring for retries and errors).

        The body is parsed as JSON once, and only where routing needs it (``prefix``, ``sticky``);
        the upstream request goes out in one write and the response is relayed as it arrives
        (``pagedllm.router.upstream``)."""
        from starlette.responses import JSONResponse, Response, StreamingResponse

        from pagedllm.router.upstream import ConnectFailed, UpstreamError

        t0 = time.perf_counter()
        scope = request.scope
        path = scope["path"]
        method = scope["method"]
        raw = await request.body()
        body: Any = None
        if raw and method == "POST" and self.policy in ("prefix", "sticky"):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # the replica answers the 400
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1") not in _DROP_REQ]
        qs = scope.get("query_string") or b""
        target = path + ("?" + qs.decode("latin-1") if qs else "")
        tried: set[int] = set()
        while True:
            rep = self._choose(path, body, request.headers, tried)
            if rep is None:
                return JSONResponse({"error": {"message": "no healthy replica to serve the request",
                                               "type": "ServiceUnavailableError", "param": None,
                                               "code": 503}}, status_code=503)
            tried.add(rep.index)
            rep.in_flight += 1
            self.m_overhead.observe(time.perf_counter() - t0)
            try:
                resp = await self._pools[rep.index].request(method, target, headers, raw)
            except ConnectFailed as e:  # never started: try another
                rep.in_flight -= 1
                self.mark_down(rep, f"ConnectError: {e}")
                self.m_retries.labels(rep.url).inc()
                continue
            except UpstreamError as e:
                rep.in_flight -= 1
                self.mark_down(rep, str(e))
                self.m_requests.labels(rep.url, "error").inc()
                return JSONResponse({"error": {"message": f"replica {rep.url} failed: {e}",
                                               "type": "InternalServerError", "param": None, "code": 502}},
                                    status_code=502, headers={"x-pagedllm-replica": rep.url})
            break
        out_headers = [(k, v) for k, v in resp.headers if k.decode("latin-1") not in _DROP_RESP]
        out_headers.append((b"x-pagedllm-replica", rep.url.encode()))
        ctype = resp.content_type.decode("latin-1")
        if "event-stream" not in ctype and "ndjson" not in ctype:
            try:
                data = await resp.read()
            except UpstreamError as e:
                self.mark_down(rep, str(e))
                self.m_requests.labels(rep.url, "error").inc()
                return JSONResponse({"error": {"message": f"replica {rep.url} failed: {e}",
                                               "type": "InternalServerError", "param": None, "code": 502}},
                                    status_code=502, headers={"x-pagedllm-replica": rep.url})
            finally:
                rep.in_flight -= 1
                await resp.aclose()
            self.m_requests.labels(rep.url, str(resp.status)).inc()
            out = Response(data, status_code=resp.status)
            out.raw_headers = [h for h in out.raw_headers if h[0] == b"content-length"] + out_headers
            return out

        async def relay():
            code = str(resp.status)
            try:
                async for chunk in resp.iter_body():
                    yield chunk
            except UpstreamError as e:
                code = "error"
                self.m_stream_errors.labels(rep.url).inc()
                self.mark_down(rep, str(e))
                yield self._error_chunk(ctype, path, f"replica {rep.url} failed mid-stream: {e}")
            finally:
                rep.in_flight -= 1
                self.m_requests.labels(rep.url, code).inc()
                await resp.aclose()

        out = StreamingResponse(relay(), status_code=resp.status)
        out.raw_headers = out_headers
        return out

    # --------------------------------------------------------------------------------------- app
    def _build_app(self) -> Any:
        import contextlib

        import httpx
        from fastapi import FastAPI
        from starlette.responses import JSONResponse, Response

        @contextlib.asynccontextmanager
        async def lifespan(app: Any):
            import socket

            # NOTE: TCP_NODELAY on the upstream sockets: a request's headers and body are separate
            # writes, which Nagle + delayed ACK would hold for ~40 ms.
            transport = httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), transport=transport)
            if any(r.kv_endpoint for r in self.replicas):
                self._sub_thread = threading.Thread(target=self._subscribe_loop, name="router-kv-events",
                                                    daemon=True)
                self._sub_thread.start()
            task = asyncio.create_task(self._health_loop())
            try:
                yield
            finally:
                task.cancel()
                self._stop.set()
                for pool in self._pools:
                    pool.close()
                await self._client.aclose()

        app = FastAPI(title="pagedllm router", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.get("/health")
        async def health() -> Response:
            ok = any(r.healthy for r in self.replicas)
            return Response(status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/router/replicas")
        async def replicas() -> JSONResponse:
            return JSONResponse({"policy": self.policy, "index": self.index.stats(), "replicas": [
                {"url": r.url, "healthy": r.healthy, "draining": r.draining, "in_flight": r.in_flight,
                 "kv_events_endpoint": r.kv_endpoint, "kv_event_batches": r.kv_events,
                 "index_blocks": self.index.replica_blocks(r.index),
                 "block_size": self.index.block_size.get(r.index), "last_error": r.last_error}
                for r in self.replicas]})

        async def set_draining(request: Request, value: bool) -> JSONResponse:
            try:
                url = (await request.json())["replica"].rstrip("/")
            except (ValueError, KeyError, TypeError, AttributeError):
                return JSONResponse({"error": {"message": 'replica: expected {"replica": URL}', "type":
                                               "BadRequestError", "param": "replica", "code": 400}}, 400)
            for r in self.replicas:
                if r.url == url:
                    r.draining = value
                    return JSONResponse({"replica": r.url, "draining": r.draining, "in_flight": r.in_flight})
            return JSONResponse({"error": {"message": f"replica: no replica {url!r}", "type": "NotFoundError",
                                           "param": "replica", "code": 404}}, 404)

        @app.post("/router/drain")
        async def drain(request: Request) -> JSONResponse:
            return await set_draining(request, True)

        @app.post("/router/undrain")
        async def undrain(request: Request) -> JSONResponse:
            return await set_draining(request, False)

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
        async def proxy(request: Request) -> Response:
            return await self.forward(request)

        return app


def probe_replicas(urls: list[str], wait_s: float = 0.0) -> list[dict]:
    """``GET /v1/models`` of every replica (retried for up to ``wait_s`` seconds); returns their
    bodies.

    Raises:
        ValueError: a replica that does not answer 200 in time, naming it.
    """
    import httpx

    out = []
    for url in urls:
        deadline = time.time() + wait_s
        while True:
            try:
                r = httpx.get(url + "/v1/models", timeout=5.0)
                if r.status_code == 200:
                    out.append(r.json())
                    break
                why = f"/v1/models answered {r.status_code}"
            except (httpx.HTTPError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            if time.time() >= deadline:
                raise ValueError(f"--replica: cannot reach {url} ({why})")
            time.sleep(0.5)
    return out


def load_router_tokenizer(tokenizer: Optional[str], models: list[dict]) -> Any:
    """The tokenizer named by ``--tokenizer``, else the one at the replicas' model path
    (``/v1/models`` ``root``, resolved as ``pagedllm serve`` resolves a model).

    Raises:
        ValueError: none could be loaded (the message asks for --tokenizer).
    """
    from pagedllm.loader.resolve import resolve_model_path
    from pagedllm.loader.tokenizer import load_tokenizer

    names = [tokenizer] if tokenizer else []
    for m in models:
        for card in m.get("data") or []:
            if card.get("root") and card.get("parent") is None and card["root"] not in names:
                names.append(card["root"])
    errors = []
    for name in names:
        try:
            return load_tokenizer(resolve_model_path(name))
        except Exception as e:  # a remote path, a name this machine does not have
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise ValueError("--tokenizer: cannot load the replicas' tokenizer for --policy prefix ("
                     + ("; ".join(errors) or "no model path reported") + "); pass --tokenizer PATH")


def add_router_args(p: Any) -> None:
    """``pagedllm router`` flags."""
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="An upstream server's base URL (http://HOST:PORT); repeat for each replica.")
    p.add_argument("--policy", default=None, choices=list(POLICIES),
                   help="Routing policy (default: prefix when --kv-events-endpoint is given, else least-load).")
    p.add_argument("--kv-events-endpoint", action="append", default=None, metavar="ENDPOINT",
                   help="A replica's KV events endpoint to subscribe to (tcp://HOST:PORT, what its "
                        "--kv-events-config endpoint binds); one per --replica, in the same order.")
    p.add_argument("--tokenizer", default=None,
                   help="Tokenizer for prefix routing (default: the model path the replicas report).")
    p.add_argument("--chat-template", default=None,
                   help="The replicas' --chat-template (a file or the template text), for prefix routing.")
    p.add_argument("--max-index-blocks", type=int, default=1_000_000,
                   help="Bound of the prefix index, in blocks (default: 1000000).")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="Prefix policy: route by prefix only when the best match covers more than this "
                        "fraction of the prompt (default: 0.5).")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="Prefix policy: the load is imbalanced (route by load) when max - min requests in "
                        "flight exceeds this (default: 32, sgl-router's) ...")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and max exceeds this times min (default: 1.5).")
    p.add_argument("--prefix-load-weight", type=float, default=0.1,
                   help="Prefix policy: the replica with the lowest (1 - share of the prompt it holds) + "
                        "this x its requests in flight gets the request (default: 0.1).")
    p.add_argument("--health-check-interval", type=float, default=2.0,
                   help="Seconds between GET /health of each replica (default: 2).")
    p.add_argument("--replica-wait", type=float, default=0.0,
                   help="Seconds to wait at start-up for every replica to answer /v1/models (default: 0).")
    p.add_argument("--host", default="0.0.0.0", help="Host to bind (default: 0.0.0.0).")
    p.add_argument("--port", type=int, default=8000, help="Port to bind (default: 8000).")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: warning).")


def build_router(args: Any) -> RouterApp:
    """A ``RouterApp`` from the parsed flags: URLs checked, replicas probed, the tokenizer loaded.

    Raises:
        ValueError: a bad URL, an unreachable replica, a bad option or no tokenizer (one line,
            naming the flag).
    """
    urls = [check_replica_url(u) for u in args.replica]
    dup = {u for u in urls if urls.count(u) > 1}
    if dup:
        raise ValueError(f"--replica: {sorted(dup)[0]} is given twice")
    kv = args.kv_events_endpoint
    policy = args.policy or ("prefix" if kv else "least-load")
    if policy == "prefix" and not kv:
        raise ValueError("--policy prefix: needs --kv-events-endpoint (one per --replica)")
    if kv is not None and len(kv) != len(urls):
        raise ValueError(f"--kv-events-endpoint: give one per --replica ({len(urls)}), got {len(kv)}")
    for ep in kv or []:
        if not ep.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--kv-events-endpoint: {ep!r} is not a tcp:// or ipc:// endpoint")
    if args.max_index_blocks < 1:
        raise ValueError(f"--max-index-blocks: must be >= 1, got {args.max_index_blocks}")
    if args.prefix_load_weight < 0:
        raise ValueError(f"--prefix-load-weight: must be >= 0, got {args.prefix_load_weight}")
    if args.health_check_interval <= 0:
        raise ValueError(f"--health-check-interval: must be > 0, got {args.health_check_interval}")
    models = probe_replicas(urls, args.replica_wait)
    tokenizer = None
    chat_template = None
    if policy == "prefix":
        tokenizer = load_router_tokenizer(args.tokenizer, models)
        if args.chat_template:
            from pagedllm.engine.chat import load_chat_template
            chat_template = load_chat_template(args.chat_template)
    return RouterApp(urls, policy, kv_endpoints=kv, tokenizer=tokenizer, chat_template=chat_template,
                     max_index_blocks=args.max_index_blocks, health_check_interval=args.health_check_interval,
                     policy_config=PolicyConfig(args.cache_threshold, args.balance_abs_threshold,
                                                args.balance_rel_threshold, args.prefix_load_weight))


def run_router(args: Any, ra: Optional[RouterApp] = None) -> int:
    """``pagedllm router``: serve ``ra`` (default: ``build_router(args)``) with uvicorn until
    interrupted."""
    import uvicorn

    ra = ra or build_router(args)
    logger.warning("pagedllm router: %d replica(s), policy %s, on http://%s:%d", len(ra.replicas), ra.policy,
                   args.host, args.port)
    from pagedllm.entrypoints.openai.preflight import bind_listen_socket

    try:
        # NOTE: a socket whose proto is IPPROTO_TCP, so that asyncio sets TCP_NODELAY on every
        # accepted connection (uvicorn's own has proto 0: a response's head and body, two writes,
        # then wait ~40 ms for the client's delayed ACK).
        sock = bind_listen_socket(args.host, args.port)
    except ValueError as e:
        from pagedllm.entrypoints.cli_utils import fail
        return fail("pagedllm router", str(e))
    config = uvicorn.Config(ra.app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=30)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


__all__ = ["RouterApp", "Replica", "add_router_args", "build_router", "run_router", "check_replica_url"]
