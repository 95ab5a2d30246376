"""The OpenAI-compatible HTTP server (``pagedllm serve``).

``build_app(engine, args)`` makes the FastAPI app around an ``EngineClient``
(``pagedllm.engine.protocol``: ``AsyncLLM``, ``DPAsyncLLM``); ``run_server(args)`` builds the
engine from the parsed ``pagedllm serve`` flags and serves the app with uvicorn until
SIGINT/SIGTERM (then it stops accepting connections, aborts the requests in flight and
returns, so the process exits 0).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import logging
import socket
import sys
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response, install_exception_handlers
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, InfillRequest, TokenizeChatRequest,
                                                  TokenizeCompletionRequest)
from pagedllm.entrypoints.openai.protocol_anthropic import anthropic_error_body
from pagedllm.entrypoints.openai.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import (OpenAIServingModels,
                                                        OpenAIServingTokenization)
from pagedllm.metrics.loggers import LoggingStatLogger

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

STATS_LOG_INTERVAL_S = 5.0


def _version() -> str:
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


def _served_names(engine: EngineClient, args: Any) -> list[str]:
    names = getattr(args, "served_model_name", None) if args is not None else None
    if isinstance(names, str):
        names = [names]
    if not names:
        names = [str(engine.model_name)]
    return list(names)


def build_app(engine: EngineClient, args: Optional[argparse.Namespace] = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    ``args`` (optional, a ``pagedllm serve`` namespace or anything with those attributes):
    served_model_name, api_key, max_logprobs, chat_template, enable_log_requests,
    enable_log_outputs, max_log_len, disable_log_stats, enable_request_id_headers (default True), metrics_prefix ("pagedllm").
    """
    get = (lambda name, default=None: getattr(args, name, default) if args is not None else default)
    served = _served_names(engine, args)
    api_key = get("api_key")
    # NOTE: --max-logprobs reaches the engine (EngineArgs.max_logprobs): its input processor checks.
    # Request logging is off by default (vLLM >= 0.10.2); --disable-log-requests is a deprecated no-op.
    common = dict(chat_template=get("chat_template"),
                  log_requests=bool(get("enable_log_requests", False)),
                  log_outputs=bool(get("enable_log_outputs", False)),
                  max_log_len=get("max_log_len"))

    serving_completion = OpenAIServingCompletion(engine, served, **common)
    from pagedllm.entrypoints.openai.cli_args import resolve_parsers
    enable_auto_tools, tool_parser_cls, reasoning_parser_cls = resolve_parsers(args)
    serving_chat = OpenAIServingChat(engine, served, enable_auto_tools=enable_auto_tools,
                                     tool_parser=tool_parser_cls,
                                     reasoning_parser=reasoning_parser_cls, **common)
    serving_models = OpenAIServingModels(engine, served, **common)
    serving_tokenization = OpenAIServingTokenization(engine, served, **common)
    servings = (serving_completion, serving_chat)
    loras = None
    if engine.enable_lora:
        from pagedllm.entrypoints.openai.serving_lora import LoRARegistry
        # NOTE: one registry shared by every endpoint: a request's `model` may name an adapter.
        loras = LoRARegistry(engine, served, get("lora_modules"))
        for s in (serving_completion, serving_chat, serving_models, serving_tokenization):
            s.loras = loras

    # Stat loggers: the engine calls record(scheduler_stats, iteration_stats) after each step.
    metrics_prefix = get("metrics_prefix", "pagedllm") or "pagedllm"
    # Data parallel: a series per replica (the engine makes its own logger).
    prom = engine.make_prometheus_logger(served[0], int(engine.max_model_len), metrics_prefix)
    loggers_list = engine.stat_loggers
    log_stats: Optional[LoggingStatLogger] = None
    loggers_list.append(prom)
    if not get("disable_log_stats", False):
        existing = [x for x in loggers_list if isinstance(x, LoggingStatLogger)]
        if existing:
            log_stats = existing[0]
        else:
            log_stats = LoggingStatLogger(interval=STATS_LOG_INTERVAL_S, memory_fn=engine.get_memory_stats)
            loggers_list.append(log_stats)

    from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_ENTRIES, ResponseStore
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
    store_size = get("responses_store_size", DEFAULT_MAX_ENTRIES)
    serving_responses = OpenAIServingResponses(serving_chat, ResponseStore(
        DEFAULT_MAX_ENTRIES if store_size is None else int(store_size), registry=prom.registry,
        model_name=served[0], prefix=getattr(prom, "prefix", "pagedllm")))

    async def abort_all() -> None:
        await serving_responses.abort_all()
        for s in servings:
            await s.abort_all()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        if loras is not None:
            await loras.init_static_loras()  # --lora-modules; a bad one stops the start-up
        task = None
        if log_stats is not None:
            async def periodic_log() -> None:
                while True:
                    await asyncio.sleep(log_stats.interval)
                    try:
                        log_stats.maybe_log()
                    except Exception:  # pragma: no cover
                        logger.debug("stats log failed", exc_info=True)
            task = asyncio.create_task(periodic_log())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await abort_all()
            for x in (prom, log_stats):
                if x is not None and x in loggers_list:
                    loggers_list.remove(x)

    app = FastAPI(title="pagedllm OpenAI-compatible API", version=_version(), lifespan=lifespan)
    app.state.engine = engine
    app.state.served_model_names = served
    app.state.prometheus = prom
    app.state.log_stats = log_stats
    app.state.abort_all = abort_all
    app.state.servings = servings
    app.state.loras = loras
    install_exception_handlers(app)
    from fastapi.middleware.cors import CORSMiddleware
    app.add_middleware(CORSMiddleware, allow_origins=list(get("allowed_origins", ["*"]) or ["*"]),
                       allow_methods=list(get("allowed_methods", ["*"]) or ["*"]),
                       allow_headers=list(get("allowed_headers", ["*"]) or ["*"]),
                       allow_credentials=bool(get("allow_credentials", False)))
    if get("enable_request_id_headers", True) is not False:
        from pagedllm.entrypoints.openai.serving_engine import RequestIdHeaderMiddleware
        app.add_middleware(RequestIdHeaderMiddleware)
    from pagedllm.entrypoints.openai.serving_pooling import build_pooling_router
    app.include_router(build_pooling_router(engine, served))

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authentication(request: Request, call_next):
            # Only the OpenAI routes are protected (as vLLM does). Anthropic clients send the
            # key as `x-api-key`; either header is accepted.
            # The Ollama routes (/api/...) are protected too, but for /api/version (a probe).
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

    if get("enable_sleep_mode", False):  # (refused at start-up for data-parallel engines)
        _add_sleep_routes(app, engine)

    def _check_generate_runner() -> None:
        if engine.runner != "generate":
            raise OpenAIError("This model does not support text generation (it was started "
                              "with --runner pooling).", 400, "model")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        _check_generate_runner()
        return await serving_completion.create_completion(request, raw_request)

    @app.post("/infill")
    async def create_infill(request: InfillRequest, raw_request: Request):
        # llama.cpp server's fill-in-the-middle route (models whose tokenizer has FIM tokens).
        _check_generate_runner()
        return await serving_completion.create_infill(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        _check_generate_runner()
        return await serving_chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        _check_generate_runner()
        return await serving_responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return serving_responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return serving_responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await serving_responses.cancel(response_id)

    serving_messages = AnthropicServingMessages(serving_chat)

    @app.post("/v1/messages")
    async def create_message(raw_request: Request):
        if engine.runner != "generate":
            return JSONResponse(anthropic_error_body(
                "This model does not support text generation.", 400), status_code=400)
        return await serving_messages.handle(raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw_request: Request):
        return await serving_messages.handle(raw_request, count_only=True)

    @app.get("/v1/models")
    async def show_available_models():
        return JSONResponse(serving_models.show_available_models().model_dump(mode="json"))

    if loras is not None:
        from pagedllm.entrypoints.openai.serving_lora import runtime_updating_allowed
        if runtime_updating_allowed(args):
            @app.post("/v1/load_lora_adapter")
            async def load_lora_adapter(request: LoadLoRAAdapterRequest):
                return Response(content=await loras.load(request), status_code=200)

            @app.post("/v1/unload_lora_adapter")
            async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
                return Response(content=await loras.unload(request), status_code=200)

    # Ollama-compatible routes (/api/chat, /api/generate, /api/tags, ...; HEAD /) and the web
    # chat page (GET /, /ui/...).
    from pagedllm.entrypoints.openai.serving_ollama import build_ollama_router
    from pagedllm.entrypoints.web import build_web_router
    app.include_router(build_ollama_router(engine, serving_chat, served))
    app.include_router(build_web_router())

    @app.get("/health")
    async def health():
        try:
            await engine.check_health()
        except Exception as e:
            return error_response(f"Engine is not healthy: {e}", 503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def show_version():
        return JSONResponse({"version": _version()})

    @app.post("/tokenize")
    async def tokenize(request: TokenizeChatRequest | TokenizeCompletionRequest):
        return JSONResponse(serving_tokenization.tokenize(request).model_dump(mode="json",
                                                                              exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return JSONResponse(serving_tokenization.detokenize(request).model_dump(mode="json"))

    @app.get("/metrics")
    async def metrics():
        # Refresh the gauges from the scheduler now (the engine may be idle, not stepping).
        try:
            s = engine.get_scheduler_stats()
            prom.set_scheduler_gauges(s.get("num_running", 0), s.get("num_waiting", 0),
                                      s.get("kv_cache_usage", 0.0))
            prom.gauge_so_entries.set(s.get("structured_output_cache_entries", 0))
            if "lora_running_adapters" in s:
                prom.record_lora(s)
            if "encoder_cache" in s:
                prom.record_encoder_cache(s["encoder_cache"])
            if "kv_connector" in s and hasattr(prom, "record_kv_connector"):
                prom.record_kv_connector(s["kv_connector"])
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

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = await engine.reset_prefix_cache()
        if ok is False:
            return error_response("Failed to reset the prefix cache (requests are running).", 409)
        return Response(status_code=200)

    return app


#: Routes that need the model's weights: answered 503 while the model sleeps (vLLM's list, plus
#: the Responses, Messages and Ollama generation routes).
SLEEP_PROTECTED_PATHS = frozenset((
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
    "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
    "/invocations", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"))


def _add_sleep_routes(app: FastAPI, engine: Any) -> None:
    """vLLM's sleep-mode routes (``--enable-sleep-mode``): ``POST /sleep?level=1|2``, ``POST
    /wake_up[?tags=weights&tags=kv_cache]``, ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``;
    while asleep the generation routes (``SLEEP_PROTECTED_PATHS``) answer 503."""
    from pagedllm.worker.sleep import EngineSleepingError, check_level, check_tags

    @app.middleware("http")
    async def sleeping_guard(request: Request, call_next):
        if request.method == "POST" and request.url.path in SLEEP_PROTECTED_PATHS and engine.sleeping:
            return error_response(str(EngineSleepingError()), 503)
        return await call_next(request)

    @app.post("/sleep")
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
        await app.state.abort_all()
        await engine.sleep(level)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw_request: Request):
        tags = raw_request.query_params.getlist("tags") or None
        try:
            tags = check_tags(tags) if tags is not None else None
        except ValueError as e:
            raise OpenAIError(str(e), 400, "tags") from None
        await engine.wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})


# ------------------------------------------------------------------------------------------
# run_server
# ------------------------------------------------------------------------------------------


def engine_args_from_namespace(args: argparse.Namespace):
    """EngineArgs from ``pagedllm serve`` flags (same names)."""
    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.openai.cli_args import resolve_model_arg

    resolve_model_arg(args)
    kwargs = {}
    for f in dataclasses.fields(EngineArgs):
        val = getattr(args, f.name, None)
        if val is not None:  # unset flags keep EngineArgs' defaults
            kwargs[f.name] = val
    return EngineArgs(**kwargs)


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                            datefmt="%m-%d %H:%M:%S")
    logging.getLogger("pagedllm").setLevel(logging.INFO)


def run_server(args: argparse.Namespace, sock: Optional[socket.socket] = None) -> int:
    """Build the engine from ``args``, serve until SIGINT/SIGTERM; returns 0 (2: a user mistake,
    one line on stderr).

    Args:
        args: the parsed ``pagedllm serve`` flags.
        sock: the listening socket from ``preflight.prepare_serve(args)`` (the CLI calls it before
            importing this module, so mistakes show within a second); None = do that here.
    """
    from pagedllm.entrypoints.cli_utils import fail

    _setup_logging()
    if sock is None:
        from pagedllm.entrypoints.openai.preflight import prepare_serve

        try:
            sock = prepare_serve(args)
        except ValueError as e:
            return fail("pagedllm serve", str(e))
    import uvicorn

    from pagedllm.engine.async_llm import AsyncLLM

    host = getattr(args, "host", "127.0.0.1") or "127.0.0.1"
    port = int(getattr(args, "port", 8000))
    if getattr(args, "reasoning_parser", None):
        # Structured outputs constrain the answer, not the reasoning (vLLM: the reasoning
        # parser is part of the structured-outputs config).
        cfg = dict(getattr(args, "structured_outputs_config", None) or {})
        cfg.setdefault("reasoning_parser", args.reasoning_parser)
        args.structured_outputs_config = cfg
    try:
        engine_args = engine_args_from_namespace(args)
        if engine_args.enable_sleep_mode and engine_args.data_parallel_size > 1:
            raise ValueError("--enable-sleep-mode: not supported with --data-parallel-size > 1 yet")
        if engine_args.data_parallel_size > 1:
            from pagedllm.engine.dp_async_llm import DPAsyncLLM
            engine = DPAsyncLLM.from_engine_args(engine_args)
        else:
            engine = AsyncLLM.from_engine_args(engine_args)
    except ValueError as e:  # what the engine rejects at load (KV cache too small, a format, ...)
        sock.close()
        logger.debug("engine start-up failed", exc_info=True)
        return fail("pagedllm serve", str(e))
    app = build_app(engine, args)
    served = app.state.served_model_names
    print(f"pagedllm: serving model {served[0]!r} on http://{host}:{port} "
          f"(OpenAI API at http://{host}:{port}/v1, Ollama API at http://{host}:{port}/api, "
          f"web chat at http://{host}:{port}/)", flush=True)
    print(f"pagedllm: KV cache capacity: {engine.kv_capacity_tokens} tokens; "
          f"max_model_len: {engine.max_model_len}", flush=True)

    config = uvicorn.Config(app, host=host, port=port,
                            log_level=getattr(args, "uvicorn_log_level", "info") or "info",
                            timeout_keep_alive=5, timeout_graceful_shutdown=10)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT / SIGTERM
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # A requested shutdown is a clean exit (status 0): don't re-raise the signal.
            self._captured_signals.clear()
            if first:
                loop = getattr(app.state, "loop", None)
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(app.state.abort_all()))

    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        try:
            engine.shutdown()
        except Exception:
            logger.debug("engine shutdown failed", exc_info=True)
    if not server.started:  # e.g. a --lora-modules adapter that could not be loaded
        print("pagedllm serve: error: the server did not start (see the log above)", file=sys.stderr, flush=True)
        return 1
    print("pagedllm: server stopped", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser = make_arg_parser()
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
