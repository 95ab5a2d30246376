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
import logging
import socket
import sys
from typing import Any, Callable, Optional

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import install_exception_handlers
from pagedllm.entrypoints.openai.serving_admin import (SLEEP_PROTECTED_PATHS, InvocationsMiddleware,  # noqa: F401
                                                       build_admin_router, build_sleep_router,
                                                       install_api_key_auth, install_sleep_guard,
                                                       server_version)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, build_chat_router
from pagedllm.entrypoints.openai.serving_completion import (OpenAIServingCompletion,
                                                            build_completion_router)
from pagedllm.entrypoints.openai.serving_engine import RequestIdHeaderMiddleware
from pagedllm.entrypoints.openai.serving_lora import build_lora_router
from pagedllm.entrypoints.openai.serving_messages import (AnthropicServingMessages,
                                                          build_messages_router)
from pagedllm.entrypoints.openai.serving_models import (OpenAIServingModels, OpenAIServingTokenization,
                                                        build_models_router, build_tokenization_router)
from pagedllm.entrypoints.openai.serving_ollama import build_ollama_router
from pagedllm.entrypoints.openai.serving_pooling import build_pooling_router
from pagedllm.entrypoints.openai.serving_responses import build_responses_router
from pagedllm.entrypoints.web import build_web_router
from pagedllm.metrics.loggers import LoggingStatLogger

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

STATS_LOG_INTERVAL_S = 5.0


_version = server_version  # (the name older callers import)


def _served_names(engine: EngineClient, args: Any) -> list[str]:
    names = getattr(args, "served_model_name", None) if args is not None else None
    if isinstance(names, str):
        names = [names]
    if not names:
        names = [str(engine.model_name)]
    return list(names)


class _Servings:
    """The serving objects behind the routes, the shared LoRA registry and the stat loggers, built
    from the ``pagedllm serve`` namespace (see ``build_app``); ``lifespan`` is the app's."""

    def __init__(self, engine: EngineClient, args: Optional[argparse.Namespace]) -> None:
        from pagedllm.entrypoints.openai.cli_args import resolve_parsers
        from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_ENTRIES, ResponseStore
        from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

        get = (lambda name, default=None: getattr(args, name, default) if args is not None else default)
        self.engine = engine
        self.served = served = _served_names(engine, args)
        # NOTE: --max-logprobs reaches the engine (EngineArgs.max_logprobs): its input processor checks.
        # Request logging is off by default (vLLM >= 0.10.2); --disable-log-requests is a deprecated no-op.
        common = dict(chat_template=get("chat_template"),
                      log_requests=bool(get("enable_log_requests", False)),
                      log_outputs=bool(get("enable_log_outputs", False)),
                      max_log_len=get("max_log_len"))
        self.completion = OpenAIServingCompletion(engine, served, **common)
        enable_auto_tools, tool_parser_cls, reasoning_parser_cls = resolve_parsers(args)
        self.chat = OpenAIServingChat(engine, served, enable_auto_tools=enable_auto_tools,
                                      tool_parser=tool_parser_cls, reasoning_parser=reasoning_parser_cls,
                                      **common)
        self.models = OpenAIServingModels(engine, served, **common)
        self.tokenization = OpenAIServingTokenization(engine, served, **common)
        self.generation = (self.completion, self.chat)
        self.loras: Any = None
        if engine.enable_lora:
            from pagedllm.entrypoints.openai.serving_lora import LoRARegistry
            # NOTE: one registry shared by every endpoint: a request's `model` may name an adapter.
            self.loras = LoRARegistry(engine, served, get("lora_modules"))
            for s in (self.completion, self.chat, self.models, self.tokenization):
                s.loras = self.loras

        # Stat loggers: the engine calls record(scheduler_stats, iteration_stats) after each step.
        metrics_prefix = get("metrics_prefix", "pagedllm") or "pagedllm"
        # Data parallel: a series per replica (the engine makes its own logger).
        self.prom = prom = engine.make_prometheus_logger(served[0], int(engine.max_model_len), metrics_prefix)
        self.loggers_list = engine.stat_loggers
        self.log_stats: Optional[LoggingStatLogger] = None
        self.loggers_list.append(prom)
        if not get("disable_log_stats", False):
            existing = [x for x in self.loggers_list if isinstance(x, LoggingStatLogger)]
            if existing:
                self.log_stats = existing[0]
            else:
                self.log_stats = LoggingStatLogger(interval=STATS_LOG_INTERVAL_S, memory_fn=engine.get_memory_stats)
                self.loggers_list.append(self.log_stats)

        store_size = get("responses_store_size", DEFAULT_MAX_ENTRIES)
        self.responses = OpenAIServingResponses(self.chat, ResponseStore(
            DEFAULT_MAX_ENTRIES if store_size is None else int(store_size), registry=prom.registry,
            model_name=served[0], prefix=getattr(prom, "prefix", "pagedllm")))
        self.messages = AnthropicServingMessages(self.chat)

    def app_state(self) -> dict[str, Any]:
        """What ``app.state`` carries (tests and ``run_server`` read it)."""
        return dict(engine=self.engine, served_model_names=self.served, prometheus=self.prom,
                    log_stats=self.log_stats, abort_all=self.abort_all, servings=self.generation,
                    loras=self.loras)

    async def abort_all(self) -> None:
        """Server shutdown / sleep: end every request in flight."""
        await self.responses.abort_all()
        for s in self.generation:
            await s.abort_all()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """Start-up: the static LoRA adapters (a bad one stops it), the periodic stats log;
        shutdown: abort what runs, detach the stat loggers from the engine."""
        app.state.loop = asyncio.get_running_loop()
        if self.loras is not None:
            await self.loras.init_static_loras()  # --lora-modules; a bad one stops the start-up
        task = None
        log_stats = self.log_stats
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
            await self.abort_all()
            for x in (self.prom, log_stats):
                if x is not None and x in self.loggers_list:
                    self.loggers_list.remove(x)


#: Routers added by ``register_router``: ``(servings, args) -> APIRouter`` builders.
_ROUTER_BUILDERS: list[Callable[[_Servings, Optional[argparse.Namespace]], APIRouter]] = []


def register_router(builder: Callable[[_Servings, Optional[argparse.Namespace]], APIRouter]
                    ) -> Callable[[_Servings, Optional[argparse.Namespace]], APIRouter]:
    """Serve one more router in every app ``build_app`` makes afterwards (a decorator).

    A new endpoint is one file plus this registration: ``builder(servings, args)`` gets the
    app's serving objects (``servings.engine``, ``.served`` model names, ``.loras``, ``.chat``,
    ``.completion``, ...) and the ``pagedllm serve`` namespace (or None), and returns an
    ``APIRouter`` whose handlers typically subclass ``OpenAIServing`` and answer through its
    ``prepare`` / ``run`` template (``tests/entrypoints/test_custom_endpoint.py`` shows one).
    Returns ``builder``.
    """
    _ROUTER_BUILDERS.append(builder)
    return builder


def build_app(engine: EngineClient, args: Optional[argparse.Namespace] = None) -> FastAPI:
    """The FastAPI app serving ``engine``: one router per serving module.

    ``args`` (optional, a ``pagedllm serve`` namespace or anything with those attributes):
    served_model_name, api_key, max_logprobs, chat_template, enable_log_requests,
    enable_log_outputs, max_log_len, disable_log_stats, enable_request_id_headers (default True),
    metrics_prefix ("pagedllm"), allowed_origins/methods/headers, allow_credentials,
    enable_sleep_mode, lora_modules, responses_store_size, tool and reasoning parser flags.
    """
    get = (lambda name, default=None: getattr(args, name, default) if args is not None else default)
    s = _Servings(engine, args)
    app = FastAPI(title="pagedllm OpenAI-compatible API", version=server_version(), lifespan=s.lifespan)
    for key, value in s.app_state().items():
        setattr(app.state, key, value)
    install_exception_handlers(app)
    app.add_middleware(CORSMiddleware, allow_origins=list(get("allowed_origins", ["*"]) or ["*"]),
                       allow_methods=list(get("allowed_methods", ["*"]) or ["*"]),
                       allow_headers=list(get("allowed_headers", ["*"]) or ["*"]),
                       allow_credentials=bool(get("allow_credentials", False)))
    if get("enable_request_id_headers", True) is not False:
        app.add_middleware(RequestIdHeaderMiddleware)
    app.add_middleware(InvocationsMiddleware, pooling=engine.runner == "pooling")
    app.include_router(build_pooling_router(engine, s.served, s.loras, s.chat))
    if get("api_key"):
        install_api_key_auth(app, get("api_key"))
    if get("enable_sleep_mode", False):  # (refused at start-up for data-parallel engines)
        install_sleep_guard(app, engine)
        app.include_router(build_sleep_router(engine))
    for router in (build_completion_router(s.completion), build_chat_router(s.chat),
                   build_responses_router(s.responses), build_messages_router(s.messages),
                   build_models_router(s.models), build_lora_router(s.loras, args),
                   # Ollama-compatible routes (/api/chat, /api/generate, /api/tags, ...; HEAD /)
                   # and the web chat page (GET /, /ui/...).
                   build_ollama_router(engine, s.chat, s.served), build_web_router(),
                   build_admin_router(engine, s.prom), build_tokenization_router(s.tokenization),
                   *(build(s, args) for build in _ROUTER_BUILDERS)):
        app.include_router(router)
    return app


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
    if int(getattr(args, "data_parallel_size", 1) or 1) > 1 and getattr(args, "data_parallel_backend", "mp") == "ray":
        # NOTE: every replica's ranks become Ray actors placed by the cluster (one node's CPUs full, the
        # next replica's go to another node); the replicas' engine fronts stay on this machine.
        args.distributed_executor_backend = "ray"
    from pagedllm.router.dp_serve import run_dp_serve, uses_router
    if uses_router(args):  # --data-parallel-size N: N replica processes behind the router
        return run_dp_serve(args, sock)
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
        if engine_args.data_parallel_size > 1 and getattr(args, "dp_replica_rank", None) is None:
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
