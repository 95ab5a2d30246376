"""The server's own routes and middleware (not tied to one OpenAI endpoint).

``build_admin_router(engine, prom)``: ``GET /health``, ``GET|POST /ping``, ``GET /version``,
``GET /metrics`` (Prometheus text), ``POST /reset_prefix_cache``.
``build_sleep_router(engine)`` + ``install_sleep_guard(app, engine)``: vLLM's sleep-mode routes
(``--enable-sleep-mode``). ``install_api_key_auth(app, api_key)``: the ``--api-key`` check.
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.errors import OpenAIError, error_response
from pagedllm.entrypoints.openai.protocol_anthropic import anthropic_error_body
from pagedllm.metrics.prometheus import record_scheduler_snapshot

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")


def server_version() -> str:
    """pagedllm's version (``pagedllm.__version__``, else the installed distribution's, else
    "0.1.0"): the app's OpenAPI version and ``GET /version``."""
    try:
        import pagedllm
        v = getattr(pagedllm, "__version__", None)
        if v:
            return str(v)
    except Exception:
        pass
    try:
        from importlib.metadata import version
        return version("pagedllm")
    except Exception:
        return "0.1.0"


def install_api_key_auth(app: FastAPI, api_key: str) -> None:
    """``--api-key``: the OpenAI routes (``/v1...``) and the Ollama routes (``/api/...`` but
    ``/api/version``, a probe) answer 401 without ``Authorization: Bearer <key>`` or
    ``x-api-key: <key>`` (Anthropic clients); the body is the route family's error shape."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authentication(request: Request, call_next):
        path = request.url.path
        protected = path.startswith("/v1") or (path.startswith("/api/") and path != "/api/version")
        if request.method != "OPTIONS" and protected:
            got = request.headers.get("Authorization", "").encode()
            got_x = ("Bearer " + request.headers.get("x-api-key", "")).encode()
            if not (hmac.compare_digest(got, expected) or hmac.compare_digest(got_x, expected)):
                msg = "Unauthorized: missing or invalid API key."
                if request.url.path.startswith("/v1/messages"):
                    return JSONResponse(anthropic_error_body(msg, 401), status_code=401)
                if path.startswith("/api/"):
                    return JSONResponse({"error": msg}, status_code=401)
                return error_response(msg, 401, None, "AuthenticationError")
        return await call_next(request)


def build_admin_router(engine: Any, prom: Any) -> APIRouter:
    """Health, version, Prometheus metrics (``prom``: the server's ``PrometheusStatLogger``,
    whose gauges are refreshed from the scheduler on each scrape) and the prefix-cache reset."""
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        try:
            await engine.check_health()
        except Exception as e:
            return error_response(f"Engine is not healthy: {e}", 503)
        return Response(status_code=200)

    @router.api_route("/ping", methods=["GET", "POST", "HEAD"])
    async def ping():
        return await health()

    @router.get("/version")
    async def show_version():
        return JSONResponse({"version": server_version()})

    @router.get("/metrics")
    async def metrics():
        # Refresh the gauges from the scheduler now (the engine may be idle, not stepping).
        try:
            s = engine.get_scheduler_stats()
            record_scheduler_snapshot(prom, s)
            if "encoder_cache" in s:
                prom.record_encoder_cache(s["encoder_cache"])
            kvs = s.get("kv_connector")  # live for P2P (AsyncLLM.get_scheduler_stats)
            if kvs is not None and hasattr(prom, "record_kv_connector"):
                prom.record_kv_connector(kvs)
        except Exception:
            logger.debug("get_scheduler_stats failed", exc_info=True)
        try:
            prom.record_memory(engine.get_memory_stats())
        except Exception:
            logger.debug("get_memory_stats failed", exc_info=True)
        try:
            st = engine.get_kv_events_stats()
            if st:
                prom.record_kv_events(st)
        except Exception:
            logger.debug("get_kv_events_stats failed", exc_info=True)
        return Response(prom.render(), media_type=prom.content_type)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = await engine.reset_prefix_cache()
        if ok is False:
            return error_response("Failed to reset the prefix cache (requests are running).", 409)
        return Response(status_code=200)

    return router


#: Routes that need the model's weights: answered 503 while the model sleeps (vLLM's list, plus
#: the Responses, Messages and Ollama generation routes).
SLEEP_PROTECTED_PATHS = frozenset((
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
    "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
    "/invocations", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"))


def install_sleep_guard(app: FastAPI, engine: Any) -> None:
    """While the model sleeps, POSTs to ``SLEEP_PROTECTED_PATHS`` answer 503."""
    from pagedllm.worker.sleep import EngineSleepingError

    @app.middleware("http")
    async def sleeping_guard(request: Request, call_next):
        if request.method == "POST" and request.url.path in SLEEP_PROTECTED_PATHS and engine.sleeping:
            return error_response(str(EngineSleepingError()), 503)
        return await call_next(request)


def build_sleep_router(engine: Any) -> APIRouter:
    """vLLM's sleep-mode routes: ``POST /sleep?level=1|2`` (requests in flight end first: the
    app's ``state.abort_all``), ``POST /wake_up[?tags=weights&tags=kv_cache]``, ``GET
    /is_sleeping`` -> ``{"is_sleeping": bool}``. Bad ``level`` / ``mode`` / ``tags``: 400."""
    from pagedllm.worker.sleep import check_level, check_tags

    router = APIRouter()

    @router.post("/sleep")
    async def sleep(raw_request: Request):
        q = raw_request.query_params
        try:
            level = check_level(q.get("level", "1"))
        except ValueError as e:
            raise OpenAIError(str(e), 400, "level") from None
        mode = q.get("mode", "abort")
        if mode != "abort":
            raise OpenAIError(f"mode: only 'abort' (vLLM's default) is supported, got {mode!r}", 400, "mode")
        # NOTE: requests in flight end now (streams with finish_reason "abort", others 503).
        await raw_request.app.state.abort_all()
        await engine.sleep(level)
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(raw_request: Request):
        tags = raw_request.query_params.getlist("tags") or None
        try:
            tags = check_tags(tags) if tags is not None else None
        except ValueError as e:
            raise OpenAIError(str(e), 400, "tags") from None
        await engine.wake_up(tags)
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    return router


def invocation_path(body: Any, pooling: bool) -> Optional[str]:
    """The route a SageMaker ``POST /invocations`` body is for (vLLM routes by the request's
    type): ``messages`` -> chat completions (a pooling model: embeddings of the chat),
    ``prompt`` -> completions, ``input`` -> embeddings (a generation model: Responses),
    ``query`` + ``documents`` -> rerank, ``text_1`` / ``queries`` / ``data_1`` -> score; None
    when it is none of these."""
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return "/v1/embeddings" if pooling else "/v1/chat/completions"
    if "query" in body and "documents" in body:
        return "/rerank"
    if any(k in body for k in ("text_1", "queries", "data_1")):
        return "/score"
    if "prompt" in body:
        return "/v1/completions"
    if "input" in body:
        return "/v1/embeddings" if pooling else "/v1/responses"
    return None


class InvocationsMiddleware:
    """ASGI middleware: ``POST /invocations`` (SageMaker's inference route, as vLLM serves it)
    runs the route its body is for (``invocation_path``), as if posted there: the same
    handler, validation, streaming and errors. A body of no known type is a 400."""

    def __init__(self, app: Any, pooling: bool = False) -> None:
        self.app, self.pooling = app, pooling

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/invocations" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        try:
            obj = json.loads(body) if body else None
        except ValueError:
            obj = None
        target = invocation_path(obj, self.pooling)
        if target is None:
            await error_response("invocations: the body is not a request this server knows (it needs "
                                 "messages, prompt, input, query + documents or text_1 / text_2)", 400)(
                scope, receive, send)
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(dict(scope, path=target, raw_path=target.encode()), replay, send)
