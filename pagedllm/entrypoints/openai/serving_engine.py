"""Shared machinery of the OpenAI endpoints: model-name checks, prompt tokenization and
validation, running several engine generators at once, disconnect handling, SSE responses."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Optional, Sequence

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.engine.input_processor import InputProcessor, ProcessedPrompt
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, value_error_to_openai
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


def abort_unfinished(finished: list[bool], chunk: Callable[[int], str]) -> Iterator[str]:
    """Server shutdown cut a stream: ``chunk(i)`` (an event with finish_reason "abort", as vLLM
    ends them) for every choice ``i`` not finished yet, which is then marked finished."""
    for i, done in enumerate(finished):
        if not done:
            finished[i] = True
            yield chunk(i)


def final_outputs(outs: Sequence[Any], prompt_ids: list[int]) -> tuple[list[int], Any, dict[int, Any], int]:
    """A non-streamed prompt's results (its ``RequestOutput`` s, in order) as (the prompt token ids:
    the engine's when it reports them, else ``prompt_ids``; the prompt logprobs or None; sample
    index -> that sample's last ``CompletionOutput`` (the whole answer: the server collects
    cumulative / final-only outputs); cached prompt tokens, from the last output)."""
    final: dict[int, Any] = {}
    prompt_logprobs = None
    num_cached = 0
    for ro in outs:
        if ro.prompt_token_ids:
            prompt_ids = list(ro.prompt_token_ids)
        if ro.prompt_logprobs is not None:
            prompt_logprobs = ro.prompt_logprobs
        num_cached = int(getattr(ro, "num_cached_tokens", 0) or 0)
        for co in ro.outputs:
            final[co.index] = co
    return prompt_ids, prompt_logprobs, final, num_cached


def stream_error_body(e: Exception) -> dict[str, Any]:
    """The OpenAI error body an SSE stream ends with when ``e`` cut it: the 400 body of a
    ``ValueError`` (``value_error_to_openai``), else a 500 "Internal server error: ..." one."""
    if isinstance(e, ValueError):
        return value_error_to_openai(e).to_dict()
    return error_body(f"Internal server error: {e}", 500)


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
        self.request_ids: Optional[list[str]] = None  # the engine request ids (set when tracked)
        self.tasks: dict[int, asyncio.Future] = {}
        self.finished: set[int] = set()
        self._closed = False
        self._stopping = False

    def first_output(self, i: int = 0) -> Any:
        """Generator ``i``'s first output when ``prime`` has it ready (not consumed: iteration
        still yields it), else None."""
        t = self.tasks.get(i)
        if t is None or not t.done() or t.cancelled() or t.exception() is not None:
            return None
        return t.result()

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


@dataclasses.dataclass
class ResponseBuilder:
    """How an endpoint answers once its engine requests run (``OpenAIServing.run``).

    Attributes:
        stream: ``merged`` (the running requests) -> the server-sent events of a streamed
            response (strings).
        build: the collected outputs (per request index, ``collect``'s dict) -> the JSON body
            of a non-streamed response.
    """

    stream: Callable[["MergedGenerators"], AsyncIterator[str]]
    build: Callable[[dict[int, list[Any]]], Any]


def require_generate_runner(engine: EngineClient) -> None:
    """Raises OpenAIError (400, param "model") unless ``engine`` runs a generation model (the
    generation routes of a ``--runner pooling`` server)."""
    if engine.runner != "generate":
        raise OpenAIError("This model does not support text generation (it was started "
                          "with --runner pooling).", 400, "model")


class OpenAIServing:
    """Base of the completion/chat/tokenization handlers.

    Every prompt goes through the engine's ``input_processor`` (the input path the offline
    ``LLM`` uses too): its ``InputValidationError``s become 400s with their ``param``, renamed
    per endpoint (chat: "prompt" -> "messages", ...).
    """

    def __init__(self, engine: EngineClient, served_model_names: list[str], *,
                 chat_template: Optional[str] = None, log_requests: bool = False,
                 log_outputs: bool = False, max_log_len: Optional[int] = None):
        """``log_requests`` (``--enable-log-requests``): log each request as it arrives;
        ``log_outputs`` (``--enable-log-outputs``, only with ``log_requests``): log each finished
        choice; ``max_log_len``: most characters / token ids printed per field (None = all)."""
        from pagedllm.engine.chat import load_chat_template

        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.chat_template = load_chat_template(chat_template)
        self.log_requests = log_requests
        self.log_outputs = bool(log_outputs and log_requests)
        self.max_log_len = max_log_len
        self.inflight: collections.Counter[str] = collections.Counter()  # engine request ids in flight
        self.inflight_streams: set[MergedGenerators] = set()
        # The served LoRA adapters (``serving_lora.LoRARegistry``), shared by the endpoints;
        # None when the server runs without --enable-lora.
        self.loras: Any = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def default_sampling_params(self) -> dict:
        return dict(self.engine.default_sampling_params or {})

    # ---- model names -------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if not model or model in self.served_model_names or self.lora_request(model) is not None:
            return
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def response_model_name(self, model: Optional[str]) -> str:
        if model and (model in self.served_model_names or self.lora_request(model) is not None):
            return model
        return self.served_model_names[0]

    def begin_request(self, request: Any, raw_request: Optional[Request], prefix: str) -> tuple[str, int, str]:
        """Check ``request.model`` (404 when not served) and name the request: returns
        (request id ``{prefix}-{X-Request-Id or body request_id or a random id}``, recorded for the
        response header; ``created``, Unix seconds; the model name the response reports)."""
        self.check_model(request.model)
        request_id = f"{prefix}-{base_request_id(raw_request, request.request_id)}"
        record_request_id(raw_request, request_id)
        return request_id, int(time.time()), self.response_model_name(request.model)

    def lora_request(self, model: Optional[str]) -> Any:
        """The LoRA adapter a request's ``model`` names (a ``LoRARequest``), or None (a base
        model name, or no adapters served)."""
        return self.loras.get(model) if self.loras is not None and model else None

    # ---- prompts -----------------------------------------------------------------------
    @staticmethod
    def input_error(e: ValueError, rename: Optional[dict[str, str]] = None) -> OpenAIError:
        """The 400 for an input error; its ``param`` mapped through ``rename`` (the engine names
        "prompt" / "max_tokens" / "logprobs"; an endpoint may call them otherwise)."""
        err = value_error_to_openai(e)
        if rename and err.param in rename:
            err.param = rename[err.param]
        return err

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (no other check). Raises OpenAIError 400 (param "prompt")."""
        try:
            return self.input_processor.tokenize(text, add_special_tokens)
        except ValueError as e:
            raise self.input_error(e) from e

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        try:
            self.input_processor.check_token_ids(ids, field=param, param=param)
        except ValueError as e:
            raise self.input_error(e) from None

    def process_prompt(self, prompt: Any, *, truncate_prompt_tokens: Optional[int] = None,
                       add_special_tokens: bool = True,
                       rename: Optional[dict[str, str]] = None) -> ProcessedPrompt:
        """``input_processor.process_prompt`` with the server's length rule (the prompt must
        leave room for output). Raises OpenAIError 400."""
        try:
            return self.input_processor.process_prompt(prompt, truncate_prompt_tokens, add_special_tokens,
                                                       strict_length=True)
        except ValueError as e:
            raise self.input_error(e, rename) from None

    def process_inputs(self, request_id: str, prompt: ProcessedPrompt, params: Any, *,
                       cache_salt: Optional[str] = None, lora_request: Any = None,
                       rename: Optional[dict[str, str]] = None, priority: int = 0,
                       raw_request: Optional[Request] = None) -> EngineCoreRequest:
        """``input_processor.process_inputs`` (prompt + max_tokens must fit; ``lora_request``:
        the adapter the request's ``model`` names, ``lora_request(model)``; ``priority``: the
        body's, a nonzero one needs ``--scheduling-policy priority``). The W3C trace-context
        headers of ``raw_request`` (``traceparent``, ``tracestate``) ride along as the request's
        ``trace_headers`` (the parent of its span when ``--otlp-traces-endpoint`` is set).
        An id still in flight here (a client's ``X-Request-Id`` or body ``request_id`` reused while
        its first request runs) gets a random suffix, so both requests run (vLLM makes engine ids
        unique the same way); the response keeps the client's id. Raises OpenAIError 400."""
        if request_id in self.inflight:
            request_id = f"{request_id}-{random_uuid()[:8]}"
        try:
            req = self.input_processor.process_inputs(request_id, prompt, params, cache_salt=cache_salt,
                                                      lora_request=lora_request, strict_length=True,
                                                      priority=priority)
        except ValueError as e:
            raise self.input_error(e, rename) from None
        if raw_request is not None:
            from pagedllm.tracing import extract_trace_headers
            req.trace_headers = extract_trace_headers(raw_request.headers)
        return req

    def kv_transfer_response(self, request: Any, engine_request_id: str) -> Optional[dict]:
        """The response's ``kv_transfer_params`` (vLLM's disaggregated prefill): what a decoder
        needs to fetch this prefill's KV from this server's ``P2pConnector``, or None."""
        params = getattr(request, "kv_transfer_params", None)
        if not params:
            return None
        from pagedllm.distributed.kv_transfer.p2p import prefill_response_params

        return prefill_response_params(self.engine.kv_transfer_config, params, engine_request_id)

    def sampling_params(self, request: Any, prompt_len: int, rename: Optional[dict[str, str]] = None) -> Any:
        """``request.to_sampling_params`` for a prompt of ``prompt_len`` tokens (what is left of
        the context for output, the context length, the model's default sampling params).
        Raises OpenAIError 400 (the param its message names, mapped through ``rename``: the
        endpoint's name of an engine field, e.g. ``max_completion_tokens``)."""
        try:
            return request.to_sampling_params(self.max_model_len - prompt_len, self.max_model_len,
                                              self.default_sampling_params)
        except ValueError as e:
            err = value_error_to_openai(e)
            new = (rename or {}).get(err.param or "")
            if new:
                if err.message.startswith(f"{err.param} "):
                    err.message = new + err.message[len(err.param or ""):]
                err.param = new
            raise err from e

    def prepare(self, request_id: str, prompt: ProcessedPrompt, request: Any, *,
                prompt_len: Optional[int] = None, constrain: Optional[Callable[[Any], None]] = None,
                model: Optional[str] = None, log_prompt: Any = None, **inputs: Any) -> EngineCoreRequest:
        """One engine request from a processed prompt, the shared tail of every generation
        endpoint: sampling params from ``request`` (a ``CompletionRequest`` or
        ``ChatCompletionRequest``; ``prompt_len`` default: the prompt's token count), then
        ``constrain(sp)`` (tools, text formats), ``process_inputs`` (the LoRA adapter ``model``
        names; ``inputs``: its ``cache_salt``, ``rename``, ``priority``, ``raw_request``) and
        the request log line (``log_prompt``, default the prompt's text).
        Raises OpenAIError 400."""
        ids = prompt.prompt_token_ids
        sp = self.sampling_params(request, len(ids) if prompt_len is None else prompt_len, inputs.get("rename"))
        if constrain is not None:
            constrain(sp)
        req = self.process_inputs(request_id, prompt, sp, lora_request=self.lora_request(model), **inputs)
        self.log_request(request_id, prompt.prompt if log_prompt is None else log_prompt, ids,
                         req.sampling_params)
        return req

    async def run(self, requests: list[EngineCoreRequest], stream: bool, builder: ResponseBuilder,
                  raw_request: Optional[Request] = None, *,
                  length_penalty: Optional[float] = None) -> Response:
        """Start ``requests`` (a beam search when ``length_penalty`` is given) and answer:
        streamed, an ``SSEResponse`` of ``builder.stream``; else the collected outputs as the
        JSON ``builder.build`` makes, or 499 when the client went away first.
        Raises OpenAIError (400 for what the engine rejects, 503 at shutdown)."""
        rids = [r.request_id for r in requests]
        try:
            if length_penalty is not None:
                merged = await self.start_beam_search(requests, length_penalty, prime=stream)
            else:
                merged = await self.start(requests, prime=stream)
        except ValueError as e:
            raise value_error_to_openai(e) from e
        if stream:
            return SSEResponse(builder.stream(merged))
        try:
            results = await self.collect(merged, raw_request, rids)
        except ClientDisconnected:
            return Response(status_code=499)
        except ValueError as e:
            raise value_error_to_openai(e) from e
        return JSONResponse(builder.build(results))

    def _clip(self, value: Any) -> Any:
        """``value`` (a str or a list) cut to ``max_log_len`` items (None = whole)."""
        n = self.max_log_len
        if n is None or value is None or len(value) <= n:
            return value
        return value[:n]

    def log_request(self, request_id: str, prompt: Any, ids: list[int], params: Any) -> None:
        """Log one received request (``--enable-log-requests``; vLLM's line: prompt, params,
        prompt token ids)."""
        if not self.log_requests:
            return
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    request_id, self._clip(prompt), params, self._clip(list(ids)))

    async def _logged_outputs(self, gen: AsyncIterator[Any], request_id: str,
                              delta: bool) -> AsyncIterator[Any]:
        """``gen``'s outputs, unchanged; each choice that finishes is logged once
        (``--enable-log-outputs``) with its whole text and token ids (accumulated when ``delta``:
        a streamed request's outputs carry only what is new)."""
        texts: dict[int, str] = {}
        tids: dict[int, list[int]] = {}
        logged: set[int] = set()
        try:
            async for out in gen:
                for co in getattr(out, "outputs", None) or ():
                    k = co.index
                    if k in logged:
                        continue
                    if delta:
                        texts[k] = texts.get(k, "") + (co.text or "")
                        tids.setdefault(k, []).extend(co.token_ids or ())
                    else:
                        texts[k] = co.text or ""
                        tids[k] = list(co.token_ids or ())
                    if co.finish_reason is not None:
                        logged.add(k)
                        logger.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, "
                                    "finish_reason: %s", request_id, k, self._clip(texts[k]),
                                    self._clip(tids[k]), co.finish_reason)
                yield out
        finally:
            close = getattr(gen, "aclose", None)
            if close is not None:
                await close()

    # ---- running -----------------------------------------------------------------------
    async def start(self, requests: list[EngineCoreRequest], prime: bool = True) -> MergedGenerators:
        """Submit the requests. With ``prime`` (streaming), wait for each first output so a
        ValueError from the engine surfaces before the response starts; without it
        (non-streaming, FINAL_ONLY: the first output is the last) errors surface in
        ``collect``."""
        request_ids = [r.request_id for r in requests]
        gens = [self.engine.generate(r, r.sampling_params, r.request_id) for r in requests]
        if self.log_outputs:
            from pagedllm.sampling_params import RequestOutputKind
            gens = [self._logged_outputs(g, r.request_id, getattr(r.sampling_params, "output_kind", None)
                                         == RequestOutputKind.DELTA) for g, r in zip(gens, requests)]
        return await self._track(MergedGenerators(gens), request_ids, prime)

    async def _track(self, merged: MergedGenerators, request_ids: list[str], prime: bool) -> MergedGenerators:
        """Count ``merged`` (the streams of ``request_ids``) as in flight (``inflight``,
        ``inflight_streams``: what a shutdown aborts) and, with ``prime``, wait for each first
        output; an error while priming untracks them again and propagates."""
        merged.request_ids = list(request_ids)  # (the engine ids; finish untracks these)
        self.inflight.update(request_ids)
        self.inflight_streams.add(merged)
        if prime:
            try:
                await merged.prime()
            except BaseException:
                self._untrack(request_ids)
                self.inflight_streams.discard(merged)
                raise
        return merged

    async def start_beam_search(self, requests: list[EngineCoreRequest], length_penalty: float,
                                prime: bool = True) -> MergedGenerators:
        """``start`` for ``use_beam_search`` (vLLM's online beam search): each processed request
        (its ``n`` is the beam width; ``max_tokens``, ``temperature``, ``ignore_eos``,
        ``include_stop_str_in_output`` as given) runs as a beam search (``pagedllm.beam_search``)
        whose one output, yielded when it ends, holds the ``n`` best beams, best first.

        Raises:
            OpenAIError: 400 for a beam width over what ``max_logprobs`` allows, or structured
                outputs (not combined with beam search here).
        """
        from pagedllm.beam_search import beam_width_error
        from pagedllm.sampling_params import BeamSearchParams

        searches = []
        for r in requests:
            sp = r.sampling_params
            if getattr(sp, "structured_outputs", None) is not None:
                raise OpenAIError("use_beam_search: structured outputs (response_format, guided_*, forced "
                                  "tool calls) cannot be combined with beam search", 400, "use_beam_search")
            try:
                params = BeamSearchParams(beam_width=sp.n, max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos,
                                          temperature=sp.temperature, length_penalty=length_penalty,
                                          include_stop_str_in_output=sp.include_stop_str_in_output)
            except ValueError as e:
                raise OpenAIError(str(e).replace("beam_width", "n"), 400,
                                  "length_penalty" if "length_penalty" in str(e) else "n") from None
            msg = beam_width_error(params, int(getattr(self.input_processor, "max_logprobs", 20)))
            if msg:
                raise OpenAIError(msg.replace("beam_width", "n"), 400, "n")
            searches.append((r, params))
        merged = MergedGenerators([self._beam_search(r, params) for r, params in searches])
        return await self._track(merged, [r.request_id for r in requests], prime)

    async def _beam_search(self, request: EngineCoreRequest, params: Any) -> AsyncIterator[Any]:
        """One prompt's beam search over the engine; yields one final RequestOutput."""
        from pagedllm.beam_search import BeamSearch, BeamSearchInstance
        from pagedllm.outputs import CompletionOutput, RequestOutput
        from pagedllm.sampling_params import RequestOutputKind

        tok = self.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        ids = list(request.prompt_token_ids)
        plen = len(ids)
        inst = BeamSearchInstance({"prompt_token_ids": ids, "prompt": request.prompt},
                                  lora_request=request.lora_request, max_new_tokens=params.max_tokens)
        bs = BeamSearch([inst], params, eos, online=True)
        sp = bs.step_params()
        sp.output_kind = RequestOutputKind.FINAL_ONLY
        live: set[str] = set()

        async def one(rid: str, tokens: list[int]) -> Any:
            req = self.process_inputs(rid, ProcessedPrompt(None, tokens, getattr(request, "cache_salt", None)),
                                      sp.clone(), lora_request=request.lora_request,
                                      priority=int(getattr(request, "priority", 0) or 0))
            live.add(rid)
            gen = self.engine.generate(req, req.sampling_params, rid)
            last = None
            try:
                async for out in gen:
                    last = out
            finally:
                live.discard(rid)
                await gen.aclose()
            return last

        step = 0
        try:
            while True:
                beams = bs.pending()
                if not beams:
                    break
                outs = await asyncio.gather(*[one(f"{request.request_id}-beam{step}-{i}", b.tokens)
                                              for i, b in enumerate(beams)])
                bs.update([o.outputs[0].logprobs[0] if o is not None and o.outputs and o.outputs[0].logprobs
                           else None for o in outs])
                step += 1
        finally:
            if live:
                await self.abort_requests(list(live))
        outputs = []
        for i, b in enumerate(bs.best(inst)):
            gen_ids = b.tokens[plen:]
            text_ids = gen_ids[:-1] if gen_ids and gen_ids[-1] == eos and not params.ignore_eos else gen_ids
            outputs.append(CompletionOutput(index=i, text=tok.decode(text_ids), token_ids=list(gen_ids),
                                            cumulative_logprob=b.cum_logprob, logprobs=b.logprobs,
                                            finish_reason=b.finish_reason or "length", stop_reason=b.stop_reason))
        yield RequestOutput(request_id=request.request_id, prompt=request.prompt, prompt_token_ids=ids,
                            prompt_logprobs=None, outputs=outputs, finished=True)

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            try:
                await self.engine.abort(rid)
            except Exception:
                logger.debug("abort of %s failed", rid, exc_info=True)

    async def finish(self, merged: MergedGenerators, request_ids: Sequence[str]) -> None:
        """Cleanup after a request: close its generators, which aborts the engine requests they
        added and did not finish (``AsyncLLM.generate``'s own cleanup).

        ``merged.request_ids`` (the engine ids ``start`` tracked) leave ``inflight``; ``request_ids``
        only where nothing was tracked.

        NOTE: nothing is aborted by id here: an id this request never added (a client's reused
        ``X-Request-Id`` that the engine refused with a 400, when two such requests were prepared
        at once) belongs to the other request, which must run on untouched."""
        with anyio.CancelScope(shield=True):
            await merged.aclose()
            self._untrack(merged.request_ids if merged.request_ids is not None else request_ids)
            self.inflight_streams.discard(merged)

    def _untrack(self, request_ids: Sequence[str]) -> None:
        """One reference of each of ``request_ids`` off ``inflight`` (a client may reuse an id)."""
        self.inflight.subtract(request_ids)
        for rid in request_ids:
            if self.inflight.get(rid, 0) <= 0:
                self.inflight.pop(rid, None)

    async def stream_results(self, merged: MergedGenerators, request_ids: Sequence[str], *,
                             on_result: Callable[[int, Any], Iterable[str]],
                             on_end: Callable[[bool], Iterable[str]],
                             on_error: Callable[[Exception], Iterable[str]],
                             start: Callable[[], Iterable[str]] = lambda: (),
                             done: Optional[str] = None) -> AsyncIterator[str]:
        """The streaming loop every generate endpoint shares (chat, completions, responses,
        Anthropic messages); the callbacks turn engine outputs into the endpoint's own events
        (already-framed strings: ``sse(...)`` chunks or ``event:`` lines).

        ``start()``: the events before the first output (a role chunk, ``message_start``).
        ``on_result(prompt_index, RequestOutput)``: the events for one merged output.
        ``on_end(stopping)``: the closing events once every generator is exhausted; ``stopping``
        is True when server shutdown cut the stream (``MergedGenerators.stop``).
        ``on_error(exc)``: the error events for an exception raised by any of the above or by
        the engine (the callback logs it as it sees fit); the stream then ends normally.
        ``done``: one last event after the cleanup (``SSE_DONE`` for the OpenAI endpoints);
        not sent when the client went away.

        Cleanup (``finish``) always runs: the generators are closed, which aborts the engine
        requests they did not finish (a client disconnect closes this generator at a ``yield``).
        """
        try:
            for event in start():
                yield event
            async for index, result in merged:
                for event in on_result(index, result):
                    yield event
            for event in on_end(merged._stopping):
                yield event
        except Exception as e:
            for event in on_error(e):
                yield event
        finally:
            await self.finish(merged, request_ids)
        if done is not None:
            yield done

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
        try:
            waits = {task} if watcher is None else {task, watcher}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
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
            await self.finish(merged, request_ids)

    async def abort_all(self) -> None:
        """Server shutdown: end every in-flight request (responses finish early)."""
        for m in list(self.inflight_streams):
            m.stop()
        await self.abort_requests(list(self.inflight))


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
