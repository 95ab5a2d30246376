"""Shared machinery of the OpenAI endpoints: model-name checks, prompt tokenization and
validation, running several engine generators at once, disconnect handling, SSE responses."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from functools import partial
from typing import Any, AsyncIterator, Optional, Sequence

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import clamp_logprob, random_uuid

logger = logging.getLogger("pagedllm.entrypoints.openai")


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


REQUEST_ID_HEADER = "X-Request-Id"


def base_request_id(raw_request: Optional[Request], body_request_id: Optional[str] = None) -> str:
    """The base of a request's id (vLLM ``_base_request_id``): the client's ``X-Request-Id``
    header, else the body's ``request_id`` field, else a random hex string."""
    rid = raw_request.headers.get(REQUEST_ID_HEADER) if raw_request is not None else None
    return rid or body_request_id or random_uuid()


def record_request_id(raw_request: Optional[Request], request_id: str) -> None:
    """Remember ``request_id`` (the response's ``id``) for the ``X-Request-Id`` response header
    (``RequestIdHeaderMiddleware``) of a client that sent none."""
    if raw_request is not None:
        raw_request.state.request_id = request_id


class RequestIdHeaderMiddleware:
    """ASGI middleware: every HTTP response carries ``X-Request-Id``: the client's own header
    echoed, else the id the handler gave the request (``record_request_id``), else a fresh
    random one (vLLM ``--enable-request-id-headers``). Pure ASGI, so streamed responses and
    disconnect detection are untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = None
        for k, v in scope.get("headers") or []:
            if k == b"x-request-id":
                client = v.decode("latin-1")
                break

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                from starlette.datastructures import MutableHeaders
                rid = client or (scope.get("state") or {}).get("request_id") or random_uuid()
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` (a JSON string or a JSON-able object)."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always watches for client disconnects and closes its
    body generator (so the generator's cleanup aborts the engine requests) when the client
    goes away or the server shuts down."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: Optional[dict] = None):
        hdrs = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        hdrs.update(headers or {})
        super().__init__(content, media_type="text/event-stream", headers=hdrs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run_stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # client disconnected while we were sending
                        pass
                    tg.cancel_scope.cancel()

                async def run_listener() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                await run_listener()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:  # pragma: no cover - best effort cleanup
                        logger.debug("error closing stream body", exc_info=True)


class MergedGenerators:
    """Runs several engine ``generate`` iterators concurrently; yields ``(index, output)``.

    ``prime()`` waits for each generator's first item (the engine raises ValueError for a bad
    request before yielding anything), so errors surface before a response is started.
    ``aclose()`` cancels pending reads and closes every generator (aborting their requests).
    """

    def __init__(self, generators: Sequence[AsyncIterator[Any]]):
        self.gens = list(generators)
        self.tasks: dict[int, asyncio.Future] = {}
        self.finished: set[int] = set()
        self._closed = False
        self._stopping = False

    def stop(self) -> None:
        """End the iteration early (server shutdown): pending reads are cancelled (which
        aborts their engine requests) and iteration ends without an error."""
        self._stopping = True
        for t in self.tasks.values():
            t.cancel()

    def _schedule(self, i: int) -> None:
        self.tasks[i] = asyncio.ensure_future(self.gens[i].__anext__())

    async def prime(self) -> None:
        for i in range(len(self.gens)):
            self._schedule(i)
        try:
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()))
        except BaseException:
            await self.aclose()
            raise
        for i in sorted(self.tasks):
            exc = self.tasks[i].exception()
            if exc is not None and not isinstance(exc, StopAsyncIteration):
                await self.aclose()
                raise exc

    async def __aiter__(self):
        if not self.tasks and not self.finished and not self._closed:
            for i in range(len(self.gens)):
                self._schedule(i)
        while self.tasks:
            done, _ = await asyncio.wait(list(self.tasks.values()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for i in sorted(i for i, t in self.tasks.items() if t in done):
                t = self.tasks.pop(i)
                if t.cancelled() and self._stopping:
                    self.finished.add(i)
                    continue
                try:
                    item = t.result()
                except StopAsyncIteration:
                    self.finished.add(i)
                    continue
                if self._stopping:
                    yield i, item
                    continue
                self._schedule(i)
                yield i, item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for g in self.gens:
            close = getattr(g, "aclose", None)
            if close is not None:
                try:
                    await close()
                except (Exception, asyncio.CancelledError):
                    pass


class OpenAIServing:
    """Base of the completion/chat/tokenization handlers."""

    def __init__(self, engine: Any, served_model_names: list[str], *, max_logprobs: int = 20,
                 chat_template: Optional[str] = None, log_requests: bool = True,
                 ):
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.max_logprobs = max_logprobs
        self.chat_template = resolve_chat_template(chat_template)
        self.log_requests = log_requests
        self.inflight: set[str] = set()
        self.inflight_streams: set[MergedGenerators] = set()
        # The served LoRA adapters (``serving_lora.LoRARegistry``), shared by the endpoints;
        # None when the server runs without --enable-lora.
        self.loras: Any = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def default_sampling_params(self) -> dict:
        return dict(getattr(self.engine, "default_sampling_params", None) or {})

    # ---- model names -------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if not model or model in self.served_model_names or self.lora_request(model) is not None:
            return
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def response_model_name(self, model: Optional[str]) -> str:
        if model and (model in self.served_model_names or self.lora_request(model) is not None):
            return model
        return self.served_model_names[0]

    def lora_request(self, model: Optional[str]) -> Any:
        """The LoRA adapter a request's ``model`` names (a ``LoRARequest``), or None (a base
        model name, or no adapters served)."""
        return self.loras.get(model) if self.loras is not None and model else None

    # ---- prompts -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, UnicodeError) as e:
            # e.g. a lone UTF-16 surrogate ("\ud800") that JSON allows but UTF-8 cannot encode
            raise OpenAIError(f"The input text cannot be tokenized (invalid Unicode?): {e}", 400,
                              "prompt") from e

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        vocab = int(getattr(self.engine, "vocab_size", 0) or 0)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab and t >= vocab):
                raise OpenAIError(f"Token id {t} is out of vocabulary (vocab size {vocab}).",
                                  400, param)

    def validate_input(self, prompt_ids: list[int], max_tokens: Optional[int], *,
                       prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> None:
        """max_tokens: what the request asked for (None = fill the context)."""
        n = len(prompt_ids)
        if n == 0:
            raise OpenAIError("The prompt cannot be empty.", 400, prompt_param)
        mml = self.max_model_len
        if n >= mml:
            raise OpenAIError(
                f"This model's maximum context length is {mml} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages.",
                400, prompt_param)
        if max_tokens is not None and n + max_tokens > mml:
            raise OpenAIError(
                f"This model's maximum context length is {mml} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                400, max_tokens_param)

    def check_logprobs(self, logprobs: Optional[int], prompt_logprobs: Optional[int],
                       logprobs_param: str = "logprobs") -> None:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise OpenAIError(f"Requested sample logprobs of {logprobs}, which is greater than "
                              f"max allowed: {self.max_logprobs}", 400, logprobs_param)
        if prompt_logprobs is not None and prompt_logprobs > self.max_logprobs:
            raise OpenAIError(f"Requested prompt logprobs of {prompt_logprobs}, which is greater "
                              f"than max allowed: {self.max_logprobs}", 400, "prompt_logprobs")

    @staticmethod
    def truncate(ids: list[int], keep: Optional[int]) -> list[int]:
        if keep is None or len(ids) <= keep:
            return ids
        return ids[len(ids) - keep:] if keep > 0 else []

    def engine_prompt(self, ids: list[int], text: Optional[str], cache_salt: Optional[str]) -> dict:
        p: dict[str, Any] = {"prompt_token_ids": ids}
        if text is not None:
            p["prompt"] = text
        if cache_salt is not None:
            p["cache_salt"] = cache_salt
        return p

    def log_request(self, request_id: str, prompt: Any, ids: list[int], params: Any) -> None:
        if not self.log_requests:
            return
        ptxt = repr(prompt)
        if len(ptxt) > 200:
            ptxt = ptxt[:200] + "..."
        logger.info("Received request %s: prompt: %s, params: %s, prompt_token_ids: %d tokens",
                    request_id, ptxt, params, len(ids))

    # ---- running -----------------------------------------------------------------------
    async def start(self, prompts: list[dict], params: list[Any], request_ids: list[str],
                    prime: bool = True, lora_request: Any = None) -> MergedGenerators:
        """Submit the requests (with ``lora_request``: run with that LoRA adapter). With
        ``prime`` (streaming), wait for each first output so a ValueError from the engine
        surfaces before the response starts; without it (non-streaming, FINAL_ONLY: the first
        output is the last) errors surface in ``collect``."""
        kw = {} if lora_request is None else {"lora_request": lora_request}
        gens = [self.engine.generate(p, sp, rid, **kw) for p, sp, rid in zip(prompts, params, request_ids)]
        merged = MergedGenerators(gens)
        self.inflight.update(request_ids)
        self.inflight_streams.add(merged)
        if not prime:
            return merged
        try:
            await merged.prime()
        except BaseException:
            self.inflight.difference_update(request_ids)
            self.inflight_streams.discard(merged)
            raise
        return merged

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            try:
                await self.engine.abort(rid)
            except Exception:
                logger.debug("abort of %s failed", rid, exc_info=True)

    async def finish(self, merged: MergedGenerators, request_ids: Sequence[str],
                     completed: bool) -> None:
        """Cleanup after a request: close generators, abort unfinished engine requests."""
        with anyio.CancelScope(shield=True):
            await merged.aclose()
            if not completed:
                await self.abort_requests(request_ids)
            self.inflight.difference_update(request_ids)
            self.inflight_streams.discard(merged)

    async def collect(self, merged: MergedGenerators, raw_request: Optional[Request],
                      request_ids: Sequence[str]) -> dict[int, list[Any]]:
        """All outputs of a non-streamed request (per prompt index).

        Raises:
            ClientDisconnected: the client disconnected while waiting (the request is aborted).
            OpenAIError: 503 when a prompt's outputs ended before it finished (the server is
                shutting down and aborted it), instead of a 200 with missing choices.
        """
        results: dict[int, list[Any]] = {i: [] for i in range(len(merged.gens))}

        async def consume() -> None:
            async for i, out in merged:
                results[i].append(out)

        task = asyncio.ensure_future(consume())
        watcher: Optional[asyncio.Future] = None
        if raw_request is not None:
            async def watch_disconnect() -> None:
                # The request body has been read: the next message can only be a disconnect.
                while True:
                    msg = await raw_request.receive()
                    if msg.get("type") == "http.disconnect":
                        return
            watcher = asyncio.ensure_future(watch_disconnect())
        completed = False
        try:
            waits = {task} if watcher is None else {task, watcher}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                completed = True
                if any(not outs or not outs[-1].finished for outs in results.values()):
                    raise OpenAIError("the server is shutting down: the request was aborted before it "
                                      "finished", 503)
                return results
            logger.info("Client disconnected; aborting request(s) %s", list(request_ids))
            raise ClientDisconnected()
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
            if not task.done():
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
            await self.finish(merged, request_ids, completed)

    async def abort_all(self) -> None:
        """Server shutdown: end every in-flight request (responses finish early)."""
        for m in list(self.inflight_streams):
            m.stop()
        await self.abort_requests(list(self.inflight))


def resolve_chat_template(chat_template: Optional[str]) -> Optional[str]:
    """--chat-template: a path to a file holding a Jinja template, or the template itself."""
    if chat_template is None:
        return None
    try:
        if len(chat_template) < 4096 and os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return f.read()
    except OSError:
        pass
    if any(c in chat_template for c in "{}") or "\n" in chat_template:
        return chat_template
    raise ValueError(f"--chat-template {chat_template!r} is neither a readable file nor a "
                     "Jinja template string.")


def decoded_token(tokenizer: Any, token_id: int, logprob: Any, as_token_id: bool = False) -> str:
    if as_token_id:
        return f"token_id:{token_id}"
    dt = getattr(logprob, "decoded_token", None) if logprob is not None else None
    if dt is not None:
        return dt
    return tokenizer.decode([token_id])


def lp_value(logprob: Any) -> float:
    v = getattr(logprob, "logprob", logprob)
    return clamp_logprob(v)
