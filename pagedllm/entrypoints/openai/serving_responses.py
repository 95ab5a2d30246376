"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``.

A request becomes a chat conversation (``instructions`` as the system message, ``input`` items:
messages, ``function_call`` and ``function_call_output`` items; with ``previous_response_id``
the stored conversation comes first), runs through the chat path (template, tools, tool
choice, structured ``text.format``) and its output (reasoning, text, tool calls, split by the
server's parsers) becomes ``reasoning`` / ``message`` / ``function_call`` output items.
Streaming sends the typed events (``event: <type>`` + ``data: <json>``, numbered by
``sequence_number``): response.created, response.in_progress, then per item
output_item.added, its deltas and done events, output_item.done, and finally
response.completed (response.incomplete at ``max_output_tokens``, response.failed on error).
``background: true`` returns at once ("queued"); poll with GET, stop with cancel.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError, value_error_to_openai
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest, function_call_item, message_item, new_id, output_text_part, reasoning_item,
    response_dict, usage_dict)
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving_chat import (ChatToolSetup, OpenAIServingChat)
from pagedllm.entrypoints.openai.serving_engine import (ResponseBuilder, require_generate_runner)
from pagedllm.entrypoints.openai.stream_tally import OutputTally
from pagedllm.entrypoints.openai.tool_calling import check_json_schema, constrain_to_json

logger = logging.getLogger("pagedllm.entrypoints.openai")

#: ``include`` value that asks for the output text's token logprobs (OpenAI's name).
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_TEXT_PART_TYPES = ("input_text", "output_text", "text")


def _event(etype: str, seq: int, **fields: Any) -> str:
    data = json.dumps({"type": etype, "sequence_number": seq, **fields}, ensure_ascii=False,
                      separators=(",", ":"))
    return f"event: {etype}\ndata: {data}\n\n"


def _text_of(content: Any, where: str) -> str:
    """The text of a message's ``content`` (a string or a list of text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"`{where}.content` must be a string or a list of content parts.",
                          400, "input")
    texts = []
    for k, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif ptype == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise OpenAIError(f"`{where}.content[{k}]`: unsupported content part {ptype!r} "
                              "(this server accepts text only).", 400, "input")
    return "\n".join(texts)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (``function_call`` items join the assistant
    turn they follow; ``function_call_output`` items become ``tool`` messages; ``reasoning``
    items are not replayed to the template).

    Raises:
        OpenAIError: 400 naming the item for a malformed or unsupported item.
    """
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"`{where}` must be an object.", 400, "input")
        itype = item.get("type", "message")
        if itype == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise OpenAIError(f"`{where}.role` must be user, assistant, system or developer, "
                                  f"got {role!r}.", 400, "input")
            if "content" not in item:
                raise OpenAIError(f"`{where}` has no `content`.", 400, "input")
            msgs.append({"role": role, "content": _text_of(item["content"], where)})
        elif itype == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise OpenAIError(f"`{where}` (function_call) needs a string `{key}`.", 400,
                                      "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and last.get("_calls_turn"):
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call],
                             "_calls_turn": True})
        elif itype == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise OpenAIError(f"`{where}` (function_call_output) needs a string `call_id`.",
                                  400, "input")
            if "output" not in item:
                raise OpenAIError(f"`{where}` (function_call_output) needs an `output`.", 400,
                                  "input")
            out = item["output"]
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": out if isinstance(out, str) else _text_of(out, where)})
        elif itype == "reasoning":
            continue
        else:
            raise OpenAIError(f"`{where}`: unsupported item type {itype!r} (supported: message, "
                              "function_call, function_call_output, reasoning).", 400, "input")
    for m in msgs:
        m.pop("_calls_turn", None)
    return msgs


def responses_tools_to_chat(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools (flat) as Chat Completions tools."""
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise OpenAIError(f"`tools[{i}]`: only function tools are supported, got "
                              f"{t.get('type') if isinstance(t, dict) else t!r}.", 400, "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def responses_tool_choice_to_chat(tc: Any) -> Any:
    """A Responses ``tool_choice`` in Chat Completions form (strings unchanged, ``{"type":
    "function", "name": N}`` as ``{"type": "function", "function": {"name": N}}``).

    Raises:
        OpenAIError: 400 (param "tool_choice") for a malformed or unsupported choice.
    """
    if isinstance(tc, str):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function":
        if not isinstance(tc.get("name"), str):
            raise OpenAIError('Invalid `tool_choice`: a function choice is {"type": "function", '
                              '"name": "my_function"}.', 400, "tool_choice")
        return {"type": "function", "function": {"name": tc["name"]}}
    raise OpenAIError(f"`tool_choice` {tc!r} is not supported (none, auto, required or a "
                      "function).", 400, "tool_choice")


class OpenAIServingResponses:
    """The Responses endpoints, running on the chat path of ``chat``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore):
        self.chat = chat
        self.store = store

    # ---- request -> chat -------------------------------------------------------------------
    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if request.previous_response_id:
            prev = self.store.get(request.previous_response_id)
            if prev is None:
                raise OpenAIError(f"Previous response with id '{request.previous_response_id}' "
                                  "not found.", 404, "previous_response_id")
            if prev.running:
                raise OpenAIError("The previous response is still in progress.", 400,
                                  "previous_response_id")
            items = list(prev.input_items) + list(prev.response.get("output") or [])
        new = ([{"type": "message", "role": "user", "content": request.input}]
               if isinstance(request.input, str) else list(request.input))
        return items + new

    def _chat_request(self, request: ResponsesRequest, messages: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        body: dict[str, Any] = {
            "model": request.model, "messages": messages,
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "stream": bool(request.stream), "parallel_tool_calls": request.parallel_tool_calls,
            "seed": request.seed, "top_k": request.top_k, "min_p": request.min_p,
            "repetition_penalty": request.repetition_penalty, "stop": request.stop,
            "cache_salt": request.cache_salt,
        }
        if request.top_logprobs or LOGPROBS_INCLUDE in (request.include or []):
            body.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
        kwargs = dict(request.chat_template_kwargs or {})
        effort = (request.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if request.tools:
            body["tools"] = responses_tools_to_chat(request.tools)
            body["tool_choice"] = responses_tool_choice_to_chat(request.tool_choice)
        elif request.tool_choice not in ("auto", "none"):
            # a forced choice without tools: the chat path's 400 (param tool_choice), as OpenAI
            body["tool_choice"] = responses_tool_choice_to_chat(request.tool_choice)
        try:
            return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            msg = "; ".join(str(err.get("msg", "")).removeprefix("Value error, ")
                            for err in e.errors())
            raise OpenAIError(msg or "invalid request", 400, None) from None

    def _apply_text_format(self, sp: Any, request: ResponsesRequest) -> None:
        fmt = (request.text or {}).get("format") or {"type": "text"}
        ftype = fmt.get("type") if isinstance(fmt, dict) else None
        if ftype == "text":
            return
        if ftype == "json_schema":
            schema = fmt.get("schema")
            check_json_schema(schema, "text.format.schema", "text")
            constrain_to_json(sp, schema, "text")
        elif ftype == "json_object":
            constrain_to_json(sp, None, "text", json_object=True)
        else:
            raise OpenAIError(f"`text.format.type` {ftype!r} is not supported (text, json_schema, "
                              "json_object).", 400, "text")

    # ---- POST /v1/responses ----------------------------------------------------------------
    async def create_response(self, request: ResponsesRequest,
                              raw_request: Optional[Request] = None) -> Response:
        chat = self.chat
        chat.check_model(request.model)
        if request.background and not self.store.enabled:
            raise OpenAIError("`background` needs the response store, which is off "
                              "(--responses-store-size 0).", 400, "background")
        response_id = f"resp_{request.request_id or new_id('x')[2:]}"
        model_name = chat.response_model_name(request.model)
        items = self._conversation(request)
        messages = items_to_messages(items)
        if request.instructions:
            messages.insert(0, {"role": "system", "content": request.instructions})
        if not messages:
            raise OpenAIError("`input` must not be empty.", 400, "input")
        chat_req = self._chat_request(request, messages)
        setup, prompt_text = chat.render_request(chat_req, "input")
        # NOTE: the engine's field names as this endpoint calls them.
        rename = {"prompt": "input", "max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
        pp = chat.process_prompt(prompt_text, add_special_tokens=False, rename=rename)
        ids = pp.prompt_token_ids

        def constrain(sp: Any) -> None:
            chat.constrain_for_tools(sp, setup)
            if not setup.choice.forced:
                self._apply_text_format(sp, request)
        engine_request = chat.prepare(response_id, pp, chat_req, constrain=constrain, model=request.model,
                                      cache_salt=request.cache_salt, rename=rename, log_prompt=prompt_text)
        created = int(time.time())
        ctx = _Run(self, request, response_id, model_name, created, setup, ids, items)
        if request.background:
            return await ctx.start_background(engine_request)
        return await chat.run([engine_request], bool(request.stream),
                              ResponseBuilder(stream=ctx.stream, build=lambda results: ctx.build_and_save(results[0])),
                              raw_request)

    # ---- GET / DELETE / cancel -------------------------------------------------------------
    def _get(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        return entry

    def retrieve(self, response_id: str) -> Response:
        return JSONResponse(self._get(response_id).response)

    def list_input_items(self, response_id: str, after: Optional[str] = None, limit: int = 20,
                         order: str = "desc") -> Response:
        """``GET /v1/responses/{id}/input_items`` (OpenAI's list of the items used to generate a
        stored response: its input and, after ``previous_response_id``, the conversation before
        it), as ``{"object": "list", "data", "first_id", "last_id", "has_more"}``.

        Items are returned as the API's item objects: a message with string content gets its
        content as one ``input_text`` part (``output_text`` for the assistant) and
        ``status: "completed"``; an item without an ``id`` gets a stable one derived from the
        response id and its position (``msg_...``, ``fc_...``, ``fco_...``, ``item_...``).

        Args:
            after: an item id: list the items after it (in ``order``).
            limit: 1-100 items (OpenAI's bound; default 20).
            order: ``"desc"`` (newest first, OpenAI's default) or ``"asc"``.

        Raises:
            OpenAIError: 404 for an unknown response id; 400 (``limit`` / ``order`` / ``after``)
                for a value out of range or an ``after`` that is not an item of this response.
        """
        if not 1 <= limit <= 100:
            raise OpenAIError(f"`limit` must be between 1 and 100, got {limit}.", 400, "limit")
        if order not in ("asc", "desc"):
            raise OpenAIError(f"`order` must be 'asc' or 'desc', got {order!r}.", 400, "order")
        entry = self._get(response_id)
        items = [_as_input_item(it, response_id, i) for i, it in enumerate(entry.input_items)]
        if order == "desc":
            items.reverse()
        start = 0
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise OpenAIError(f"`after`: no input item '{after}' in response '{response_id}'.", 400, "after")
            start = ids.index(after) + 1
        page = items[start:start + limit]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": start + limit < len(items)})

    def delete(self, response_id: str) -> Response:
        entry = self._get(response_id)
        if entry.running and entry.task is not None:
            entry.task.cancel()
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        entry = self._get(response_id)
        if not entry.response.get("background"):
            raise OpenAIError("Only background responses can be cancelled.", 400, "response_id")
        if entry.running and entry.task is not None:
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        elif entry.response.get("status") != "cancelled":
            raise OpenAIError(f"Cannot cancel a response with status "
                              f"'{entry.response.get('status')}'.", 400, "response_id")
        return JSONResponse(entry.response)

    async def abort_all(self) -> None:
        for entry in self.store.running():
            if entry.task is not None:
                entry.task.cancel()


class _Run:
    """One Responses request being answered: output items, events, storing."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest,
                 response_id: str, model: str, created: int, setup: ChatToolSetup,
                 prompt_ids: list[int], items: list[dict[str, Any]]):
        self.serving, self.request, self.response_id = serving, request, response_id
        self.model, self.created, self.setup = model, created, setup
        self.prompt_ids, self.items = prompt_ids, items

    def _usage(self, output_tokens: int, cached: int, reasoning: Optional[str]) -> dict:
        rt = len(self.serving.chat.encode(reasoning, False)) if reasoning else 0
        return usage_dict(len(self.prompt_ids), output_tokens, cached, min(rt, output_tokens))

    def response(self, status: str, output: list, usage: Optional[dict] = None,
                 incomplete: Optional[str] = None, error: Optional[dict] = None) -> dict:
        return response_dict(self.request, self.response_id, self.model, self.created, status,
                             output, usage, incomplete, error)

    def build(self, outs: list[Any]) -> dict[str, Any]:
        """The finished response from the engine's final outputs."""
        co = outs[-1].outputs[0]
        cached = int(getattr(outs[-1], "num_cached_tokens", 0) or 0)
        parser = self.setup.new_parser()
        parsed = parser.parse(co.text) if parser.active else None
        reasoning = parsed.reasoning if parsed else None
        content = parsed.content if parsed else co.text
        output: list[dict[str, Any]] = []
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning))
        truncated = co.finish_reason == "length"
        if content or not (parsed and parsed.tool_calls):
            output.append(message_item(new_id("msg"), content or "",
                                       "incomplete" if truncated else "completed"))
            if LOGPROBS_INCLUDE in (self.request.include or []) and co.logprobs is not None:
                # every output token's logprob (OpenAI's output_text.logprobs shape)
                lps = self.serving.chat.create_logprobs(co.token_ids, co.logprobs, self.request.top_logprobs or 0)
                output[-1]["content"][0]["logprobs"] = [c.model_dump(mode="json") for c in lps.content]
        for c in (parsed.tool_calls if parsed else []):
            output.append(function_call_item(new_id("fc"), c.id, c.function.name,
                                             c.function.arguments))
        usage = self._usage(len(co.token_ids), cached, reasoning)
        if truncated:
            return self.response("incomplete", output, usage, "max_output_tokens")
        return self.response("completed", output, usage)

    def build_and_save(self, outs: list[Any]) -> dict[str, Any]:
        """``build(outs)``, stored (``save``) for ``previous_response_id`` / ``GET``."""
        resp = self.build(outs)
        self.save(resp)
        return resp

    def save(self, resp: dict[str, Any], task: Any = None) -> bool:
        if self.request.store is False:
            return False
        return self.serving.store.put(self.response_id,
                                      StoredResponse(resp, list(self.items), task))

    # ---- background --------------------------------------------------------------------
    async def start_background(self, engine_request: Any) -> Response:
        chat = self.serving.chat
        queued = self.response("queued", [])
        entry = StoredResponse(queued, list(self.items))
        if not self.serving.store.put(self.response_id, entry):
            raise OpenAIError("The response store is full of running background responses.",
                              503, "background")
        try:
            merged = await chat.start([engine_request], prime=False)
        except ValueError as e:
            self.serving.store.delete(self.response_id)
            raise value_error_to_openai(e) from e

        async def run() -> None:
            entry.response = self.response("in_progress", [])
            try:
                results = await chat.collect(merged, None, [self.response_id])
                entry.response = self.build(results[0])
            except asyncio.CancelledError:
                entry.response = self.response("cancelled", [])
            except OpenAIError as e:
                entry.response = self.response("failed", [], error={
                    "code": "server_error", "message": e.message})
            except Exception as e:  # never lose the record of a failed background response
                logger.exception("background response %s failed", self.response_id)
                entry.response = self.response("failed", [], error={
                    "code": "server_error", "message": f"{type(e).__name__}: {e}"})
            finally:
                entry.task = None

        entry.task = asyncio.ensure_future(run())
        return JSONResponse(queued)

    # ---- streaming ---------------------------------------------------------------------
    def stream(self, merged: Any) -> AsyncIterator[str]:
        seq = 0
        parser = self.setup.new_parser()
        output: list[dict[str, Any]] = []
        open_item: Optional[dict[str, Any]] = None  # the item receiving deltas
        call_items: dict[int, dict[str, Any]] = {}
        reasoning_text = ""
        tally = OutputTally(parser)

        def ev(etype: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return _event(etype, seq - 1, **fields)

        def close() -> list[str]:
            nonlocal open_item
            item, open_item = open_item, None
            if item is None:
                return []
            idx = output.index(item)
            evs = []
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                evs.append(ev("response.reasoning_text.done", item_id=item["id"],
                              output_index=idx, content_index=0, text=text))
            elif item["type"] == "message":
                part = item["content"][0]
                evs.append(ev("response.output_text.done", item_id=item["id"], output_index=idx,
                              content_index=0, text=part["text"], logprobs=[]))
                evs.append(ev("response.content_part.done", item_id=item["id"],
                              output_index=idx, content_index=0, part=part))
            else:
                evs.append(ev("response.function_call_arguments.done", item_id=item["id"],
                              output_index=idx, arguments=item["arguments"], name=item["name"]))
            # the item open when max_output_tokens cut the output (a message or a call) is incomplete
            item["status"] = "incomplete" if tally.finish_reason == "length" else "completed"
            evs.append(ev("response.output_item.done", output_index=idx, item=item))
            return evs

        def open_(item: dict[str, Any]) -> list[str]:
            nonlocal open_item
            evs = close()
            output.append(item)
            open_item = item
            idx = len(output) - 1
            added = dict(item, status="in_progress")
            if item["type"] == "message":
                added["content"] = []
            elif item["type"] == "reasoning":
                added["content"] = []
            evs.append(ev("response.output_item.added", output_index=idx, item=added))
            if item["type"] == "message":
                evs.append(ev("response.content_part.added", item_id=item["id"], output_index=idx,
                              content_index=0, part=output_text_part("")))
            return evs

        def on_delta(d: Any) -> list[str]:
            nonlocal reasoning_text
            evs: list[str] = []
            if d.reasoning:
                if open_item is None or open_item["type"] != "reasoning":
                    evs += open_(reasoning_item(new_id("rs"), ""))
                open_item["content"][0]["text"] += d.reasoning
                reasoning_text += d.reasoning
                evs.append(ev("response.reasoning_text.delta", item_id=open_item["id"],
                              output_index=len(output) - 1, content_index=0, delta=d.reasoning))
            if d.content:
                if open_item is None or open_item["type"] != "message":
                    evs += open_(message_item(new_id("msg"), ""))
                    open_item["content"] = [output_text_part("")]
                open_item["content"][0]["text"] += d.content
                evs.append(ev("response.output_text.delta", item_id=open_item["id"],
                              output_index=len(output) - 1, content_index=0, delta=d.content,
                              logprobs=[]))
            for tc in d.tool_calls:
                if tc.id is not None:
                    item = function_call_item(new_id("fc"), tc.id, tc.function.name, "")
                    call_items[tc.index] = item
                    evs += open_(item)
                frag = tc.function.arguments if tc.function is not None else None
                item = call_items.get(tc.index)
                if frag and item is not None:
                    item["arguments"] += frag
                    evs.append(ev("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=output.index(item), delta=frag))
            return evs

        def start() -> Iterator[str]:
            resp = self.response("in_progress", [])
            yield ev("response.created", response=resp)
            yield ev("response.in_progress", response=resp)

        def on_result(_: int, res: Any) -> Iterator[str]:
            for d in tally.feed(res):
                yield from on_delta(d)

        def on_end(stopping: bool) -> Iterator[str]:
            if not output:  # an empty answer is still one (empty) message
                yield from open_(message_item(new_id("msg"), ""))
                open_item["content"] = [output_text_part("")]
            yield from close()
            usage = self._usage(tally.num_tokens, tally.cached, reasoning_text or None)
            finish = tally.finish_reason
            if stopping or finish is None:
                resp = self.response("incomplete", output, usage, "cancelled")
                yield ev("response.incomplete", response=resp)
            elif finish == "length":
                resp = self.response("incomplete", output, usage, "max_output_tokens")
                yield ev("response.incomplete", response=resp)
            else:
                resp = self.response("completed", output, usage)
                yield ev("response.completed", response=resp)
            self.save(resp)

        def on_error(e: Exception) -> Iterator[str]:
            logger.error("error in responses stream %s", self.response_id, exc_info=e)
            msg = e.message if isinstance(e, OpenAIError) else f"{type(e).__name__}: {e}"
            yield ev("response.failed", response=self.response(
                "failed", output, error={"code": "server_error", "message": msg}))

        return self.serving.chat.stream_results(merged, [self.response_id], start=start,
                                                on_result=on_result, on_end=on_end, on_error=on_error)


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _as_input_item(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """A stored conversation item as the API lists it (see ``list_input_items``)."""
    out = dict(item)
    kind = out.get("type") or ("message" if "role" in out else "item")
    out["type"] = kind
    if kind == "message":
        content = out.get("content")
        if isinstance(content, str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": content}] if part == "input_text" else [
                {"type": part, "text": content, "annotations": []}]
    if kind in ("message", "function_call", "function_call_output"):
        out.setdefault("status", "completed")
    if not out.get("id"):
        digest = hashlib.sha1(f"{response_id}:{index}".encode()).hexdigest()[:24]
        out["id"] = f"{_ID_PREFIX.get(kind, 'item')}_{digest}"
    return out


def build_responses_router(serving: OpenAIServingResponses) -> APIRouter:
    """``POST /v1/responses`` (400 on a pooling model), ``GET`` / ``DELETE
    /v1/responses/{response_id}``, ``GET /v1/responses/{response_id}/input_items``, ``POST
    /v1/responses/{response_id}/cancel``."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        require_generate_runner(serving.chat.engine)
        return await serving.create_response(request, raw_request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return serving.retrieve(response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: Optional[str] = None, limit: int = 20,
                               order: str = "desc"):
        return serving.list_input_items(response_id, after=after, limit=limit, order=order)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return serving.delete(response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await serving.cancel(response_id)

    return router
