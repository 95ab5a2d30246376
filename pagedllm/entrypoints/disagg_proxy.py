"""``pagedllm disagg-proxy``: one OpenAI endpoint over a prefill instance and a decode instance.

The shape of vLLM's disaggregated-serving proxy: each ``/v1/completions`` or
``/v1/chat/completions`` request goes first to a prefiller (a ``pagedllm serve`` with
``--kv-transfer-config '{"kv_connector": "P2pConnector", "kv_role": "kv_producer", ...}'``) with
``max_tokens`` (and ``max_completion_tokens``) 1, ``stream`` off and ``kv_transfer_params:
{"do_remote_decode": true, ...}``; its response's ``kv_transfer_params`` (``remote_host``,
``remote_port``, ``remote_request_id``, ...) are put into the original request, which goes to a
decoder (``"kv_role": "kv_consumer"``), whose answer (streamed or not) is returned unchanged. The
decoder loads the prompt's KV from the prefiller and decodes; output equals one instance's.

Several ``--prefill`` / ``--decode`` URLs are used round-robin. A prefiller that fails (refused,
5xx, no ``kv_transfer_params``) is logged and the request goes to the decoder without them: the
decoder computes the prompt itself (the same tokens, later). A 4xx from the prefiller (a bad
request) is returned as it is. A client that disconnects from a stream closes the decoder
stream, which aborts the request there; the decoder then tells the prefiller to free the staged
KV (or the prefiller frees it after its ``abort_request_timeout_s``).

``GET /metrics``: ``pagedllm_disagg_proxy_requests_total{stage, outcome}``.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import logging
from typing import Any, Optional

from fastapi import Request  # NOTE: module level: FastAPI resolves the handlers' annotations here

logger = logging.getLogger("pagedllm")


def add_disagg_proxy_args(p: argparse.ArgumentParser) -> None:
    """The ``pagedllm disagg-proxy`` flags."""
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance (kv_role kv_producer), e.g. http://127.0.0.1:8100; repeatable.")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance (kv_role kv_consumer), e.g. http://127.0.0.1:8200; repeatable.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000).")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per upstream request, connect to last byte (default 600).")
    p.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level (default: warning).")


class DisaggProxy:
    """The proxy's state: upstream URLs (round-robin), an HTTP client, counters.

    Args:
        prefill: prefiller base URLs (``http://host:port``).
        decode: decoder base URLs.
        timeout: seconds per upstream request.

    Raises:
        ValueError: an empty list or a URL that is not http(s).
    """

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0) -> None:
        for name, urls in (("prefill", prefill), ("decode", decode)):
            if not urls:
                raise ValueError(f"--{name}: at least one URL")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"--{name}: expected an http(s) URL, got {u!r}")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)
        self.timeout = timeout
        self.client: Any = None
        self.counts: dict[tuple[str, str], int] = {}

    def _count(self, stage: str, outcome: str) -> None:
        self.counts[(stage, outcome)] = self.counts.get((stage, outcome), 0) + 1

    @staticmethod
    def prefill_body(body: dict) -> dict:
        """The request the prefiller gets: one token, not streamed, asking for a remote decode."""
        pb = copy.deepcopy(body)
        pb["max_tokens"] = 1
        if "max_completion_tokens" in pb:
            pb["max_completion_tokens"] = 1
        pb["stream"] = False
        pb.pop("stream_options", None)
        pb["n"] = 1
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                    "remote_engine_id": None, "remote_block_ids": None,
                                    "remote_host": None, "remote_port": None}
        return pb

    async def _prefill(self, path: str, body: dict, headers: dict) -> tuple[Optional[dict], Any]:
        """``(kv_transfer_params or None, an error response to return or None)``."""
        from fastapi.responses import Response

        url = next(self._p) + path
        try:
            r = await self.client.post(url, json=self.prefill_body(body), headers=headers)
        except Exception as e:
            logger.warning("pagedllm disagg-proxy: prefill at %s failed (%s); the decoder computes the prompt",
                           url, e)
            self._count("prefill", "error")
            return None, None
        if 400 <= r.status_code < 500:
            self._count("prefill", "rejected")
            return None, Response(r.content, status_code=r.status_code,
                                  media_type=r.headers.get("content-type", "application/json"))
        kv = None
        if r.status_code == 200:
            try:
                kv = r.json().get("kv_transfer_params")
            except ValueError:
                kv = None
        if not isinstance(kv, dict):
            logger.warning("pagedllm disagg-proxy: prefill at %s answered %d without kv_transfer_params (is it "
                           "a P2pConnector kv_producer?); the decoder computes the prompt", url, r.status_code)
            self._count("prefill", "error")
            return None, None
        self._count("prefill", "ok")
        return kv, None

    async def handle(self, path: str, request: Request) -> Any:
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "expected a JSON object body", "type": "BadRequestError",
                                           "param": None, "code": 400}}, status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        kv, err = await self._prefill(path, body, headers)
        if err is not None:
            return err
        db = dict(body)
        if kv is not None:
            db["kv_transfer_params"] = kv
        url = next(self._d) + path
        req = self.client.build_request("POST", url, json=db, headers=headers)
        try:
            r = await self.client.send(req, stream=True)
        except Exception as e:
            self._count("decode", "error")
            return JSONResponse({"error": {"message": f"decode instance {url} unreachable: {e}",
                                           "type": "BadGatewayError", "param": None, "code": 502}}, status_code=502)
        self._count("decode", "ok" if r.status_code == 200 else "rejected")
        ctype = r.headers.get("content-type", "application/json")
        if not body.get("stream"):
            try:
                content = await r.aread()
            finally:
                await r.aclose()
            return Response(content, status_code=r.status_code, media_type=ctype)

        async def relay():
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()  # NOTE: a client gone mid-stream closes the decoder's stream: it aborts

        return StreamingResponse(relay(), status_code=r.status_code, media_type=ctype)

    def metrics_text(self) -> str:
        lines = ["# HELP pagedllm_disagg_proxy_requests_total Requests the proxy sent, by stage and outcome.",
                 "# TYPE pagedllm_disagg_proxy_requests_total counter"]
        for (stage, outcome), n in sorted(self.counts.items()):
            lines.append(f'pagedllm_disagg_proxy_requests_total{{stage="{stage}",outcome="{outcome}"}} {n}')
        return "\n".join(lines) + "\n"


def build_disagg_proxy(args: argparse.Namespace) -> Any:
    """The FastAPI app of ``pagedllm disagg-proxy``.

    Raises:
        ValueError: a bad URL (the message names the flag).
    """
    import contextlib

    import httpx
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, Response

    proxy = DisaggProxy(args.prefill, args.decode, args.timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.client = httpx.AsyncClient(timeout=httpx.Timeout(proxy.timeout),
                                         limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        try:
            yield
        finally:
            await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        r = await proxy.client.get(proxy.decode[0] + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        for u in proxy.prefill + proxy.decode:
            try:
                r = await proxy.client.get(u + "/health", timeout=5.0)
                if r.status_code != 200:
                    return Response(status_code=503)
            except Exception:
                return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(proxy.metrics_text())

    return app


def run_disagg_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy with uvicorn until interrupted; exit status 0."""
    import uvicorn

    app = build_disagg_proxy(args)
    logger.info("pagedllm disagg-proxy on %s:%d: prefill %s, decode %s", args.host, args.port,
                args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
