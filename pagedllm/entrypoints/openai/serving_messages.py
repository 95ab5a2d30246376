"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes a chat conversation (``system`` first; ``text`` blocks as text, ``tool_use``
blocks as assistant tool calls, ``tool_result`` blocks as ``tool`` messages), runs through the
chat path (template, tools, tool choice: ``auto`` / ``any`` = required / ``tool`` = named /
``none``), and its output becomes ``thinking`` / ``text`` / ``tool_use`` content blocks with
Anthropic's ``stop_reason`` (end_turn, max_tokens, stop_sequence, tool_use) and usage
(``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``). Streaming sends
message_start, content_block_start / content_block_delta (text_delta, input_json_delta,
thinking_delta) / content_block_stop per block, message_delta and message_stop. Every error
has Anthropic's body ``{"type": "error", "error": {"type", "message"}}``.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import (OpenAIError, format_validation_errors)
from pagedllm.entrypoints.openai.output_parser import OutputDelta
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_anthropic import (AnthropicMessagesRequest,
                                                            anthropic_error_body)
from pagedllm.entrypoints.openai.protocol_responses import new_id
from pagedllm.entrypoints.openai.serving_chat import (ChatToolSetup, OpenAIServingChat)
from pagedllm.entrypoints.openai.serving_engine import ResponseBuilder
from pagedllm.entrypoints.openai.stream_tally import OutputTally

logger = logging.getLogger("pagedllm.entrypoints.openai")


def _err(message: str, status: int = 400) -> OpenAIError:
    return OpenAIError(message, status)


def _block_text(content: Any, where: str) -> str:
    """Text of a string or a list of ``text`` blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _err(f"{where}: expected a string or a list of content blocks")
    out = []
    for k, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            btype = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _err(f"{where}.{k}: unsupported content block {btype!r} here (text only)")
        if not isinstance(b.get("text"), str):
            raise _err(f"{where}.{k}.text: Field required (a string)")
        out.append(b["text"])
    return "\n".join(out)


def tool_use_id(call_id: str) -> str:
    """A tool call's id in Anthropic's form (``toolu_...``): the OpenAI-style id the tool parsers
    give (``chatcmpl-tool-<hex>``) with Anthropic's prefix; other ids as they are."""
    prefix = "chatcmpl-tool-"
    return "toolu_" + call_id[len(prefix):] if call_id.startswith(prefix) else call_id


def messages_to_chat(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` as chat messages.

    Raises:
        OpenAIError: 400 naming the message/block for a malformed or unsupported block.
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _block_text(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _err(f"{where}.role: must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if (content == "" or content == []) and not (role == "assistant" and i == len(messages) - 1):
            raise _err(f"{where}.content: must not be empty (every message needs content, except an "
                       "optional final assistant message)")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _err(f"{where}.content: expected a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []  # a user message's text and image blocks, in order
        for k, b in enumerate(content):
            bw = f"{where}.content.{k}"
            btype = b.get("type") if isinstance(b, dict) else None
            if btype == "text":
                if not isinstance(b.get("text"), str):
                    raise _err(f"{bw}.text: Field required (a string)")
                texts.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif btype == "image" and role == "user":
                src = b.get("source")
                if not isinstance(src, dict) or src.get("type") not in ("base64", "url"):
                    raise OpenAIError(f"{bw}.source: an image block needs a source of type 'base64' (with "
                                      "`media_type` and `data`) or 'url'", 400, f"{bw}.source")
                # NOTE: decoded (and refused for a text-only model) when the chat is rendered
                parts.append({"type": "image", "source": src})
            elif btype == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise _err(f"{bw}: a tool_use block needs string `id` and `name`")
                if "input" not in b:
                    raise _err(f"{bw}.input: Field required")  # Anthropic's schema requires it
                if not isinstance(b["input"], dict):
                    raise _err(f"{bw}.input: must be an object")
                calls.append({"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            elif btype == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                    raise _err(f"{bw}: a tool_result block needs a string `tool_use_id`")
                result = _block_text(b.get("content", ""), f"{bw}.content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif btype in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not replayed to the template
            else:
                raise _err(f"{bw}: unsupported content block {btype!r} in a {role} message "
                           "(supported: text, tool_use in assistant, tool_result in user)")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif any(p["type"] == "image" for p in parts):
            out.append({"role": "user", "content": parts})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _chat_tools(tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or "name" not in t:
            raise _err(f"tools.{i}: only client tools ({{name, description, input_schema}}) "
                       "are supported")
        if not isinstance(t.get("input_schema"), dict):
            raise _err(f"tools.{i}.input_schema: Field required (a JSON schema object)")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(tc: Optional[dict[str, Any]]) -> tuple[Any, bool]:
    """(chat tool_choice, parallel calls allowed)."""
    if tc is None:
        return "auto", True
    ttype = tc.get("type") if isinstance(tc, dict) else None
    parallel = not bool(tc.get("disable_parallel_tool_use")) if isinstance(tc, dict) else True
    if ttype == "auto":
        return "auto", parallel
    if ttype == "any":
        return "required", parallel
    if ttype == "none":
        return "none", parallel
    if ttype == "tool":
        if not isinstance(tc.get("name"), str) or not tc["name"]:
            raise _err("tool_choice.name: Field required for type 'tool'")
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    raise _err(f"tool_choice.type: must be auto, any, tool or none, got {ttype!r}")


class AnthropicServingMessages:
    """The Messages endpoints, running on the chat path of ``chat``."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def handle(self, raw_request: Request, count_only: bool = False) -> Response:
        """Parse and run a request; every error is an Anthropic error body."""
        try:
            try:
                body = await raw_request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _err(f"Invalid JSON in request body: {e}") from None
            if not isinstance(body, dict):
                raise _err("The request body must be a JSON object")
            if count_only:
                body.setdefault("max_tokens", 1)
            try:
                request = AnthropicMessagesRequest.model_validate(body)
            except ValidationError as e:
                raise _err(format_validation_errors(e.errors())[0]) from None
            return await self._run(request, raw_request, count_only)
        except OpenAIError as e:
            return JSONResponse(anthropic_error_body(e.message, e.status_code),
                                status_code=e.status_code)
        except ValueError as e:
            return JSONResponse(anthropic_error_body(str(e), 400), status_code=400)

    def _prepare(self, request: AnthropicMessagesRequest, count_only: bool = False
                 ) -> tuple[ChatCompletionRequest, ChatToolSetup, str, list[int]]:
        chat = self.chat
        messages = messages_to_chat(request.system, request.messages)
        # a final assistant turn is a prefill: the reply continues it (Anthropic's "prefill")
        prefill = bool(messages) and messages[-1].get("role") == "assistant"
        body: dict[str, Any] = {
            "model": request.model, "messages": messages,
            "max_completion_tokens": request.max_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "top_k": request.top_k, "stream": bool(request.stream),
            "stop": request.stop_sequences,
            "add_generation_prompt": not prefill, "continue_final_message": prefill,
        }
        if request.thinking is not None:
            body["chat_template_kwargs"] = {
                "enable_thinking": request.thinking.get("type") == "enabled"}
        tc, parallel = _chat_tool_choice(request.tool_choice)
        if count_only and tc == "auto" and not (chat.enable_auto_tools and chat.tool_parser_cls):
            tc = "none"  # counting renders the tools into the prompt; it needs no tool-call parser
        if request.tools:
            body.update(tools=_chat_tools(request.tools), tool_choice=tc,
                        parallel_tool_calls=parallel)
        elif tc not in ("auto", "none"):
            body["tool_choice"] = tc  # any / tool without tools: the chat path's 400
        try:
            chat_req = ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise _err("; ".join(str(x.get("msg", "")).removeprefix("Value error, ")
                                 for x in e.errors())) from None
        setup, prompt_text = chat.render_request(chat_req)
        if getattr(prompt_text, "images", None):
            return chat_req, setup, prompt_text, None  # the image processor tokenizes it (_run)
        return chat_req, setup, prompt_text, chat.encode(prompt_text, False)

    async def _run(self, request: AnthropicMessagesRequest, raw_request: Request,
                   count_only: bool) -> Response:
        chat = self.chat
        if request.model not in chat.served_model_names and chat.lora_request(request.model) is None:
            raise _err(f"model: {request.model!r} not found (served: "
                       f"{', '.join(chat.served_model_names)})", 404)
        chat_req, setup, prompt_text, ids = self._prepare(request, count_only)
        rename = {"prompt": "messages"}
        pp = None
        if ids is None:  # a prompt with images
            pp = chat.process_prompt(prompt_text, rename=rename)
            ids = pp.prompt_token_ids
        if count_only:
            return JSONResponse({"input_tokens": len(ids)})
        if pp is None:
            pp = chat.process_prompt({"prompt_token_ids": ids, "prompt": prompt_text}, rename=rename)
        msg_id = new_id("msg")
        engine_request = chat.prepare(msg_id, pp, chat_req, constrain=lambda sp: chat.constrain_for_tools(sp, setup),
                                      model=request.model, rename=rename, log_prompt=prompt_text)
        run = _MessageRun(chat, request, msg_id, setup, len(ids))
        return await chat.run([engine_request], bool(request.stream),
                              ResponseBuilder(stream=run.stream, build=lambda results: run.build(results[0])),
                              raw_request)


def _tool_input(arguments: Optional[str]) -> dict[str, Any]:
    """A tool call's JSON arguments as the ``tool_use`` block's ``input`` object. Arguments cut
    short by ``max_tokens`` are parsed as far as they go (``partial_json_parser``: complete
    members kept); anything that is not an object then is ``{}``."""
    text = (arguments or "").strip() or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        from partial_json_parser import loads as partial_loads
        try:
            value = partial_loads(text)
        except Exception:  # noqa: BLE001 - not even a JSON prefix
            value = {}
    return value if isinstance(value, dict) else {}


class _MessageRun:
    def __init__(self, chat: OpenAIServingChat, request: AnthropicMessagesRequest, msg_id: str,
                 setup: ChatToolSetup, input_tokens: int):
        self.chat, self.request, self.msg_id = chat, request, msg_id
        self.setup, self.input_tokens = setup, input_tokens

    def _stop(self, co: Any, called: bool) -> tuple[str, Optional[str]]:
        if co.finish_reason == "length":  # also when the cut fell inside a tool call
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(co.stop_reason, str):
            return "stop_sequence", co.stop_reason
        return "end_turn", None

    def _message(self, content: list, stop: Optional[str], stop_seq: Optional[str],
                 output_tokens: int, cached: int) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "role": "assistant",
                "model": self.request.model, "content": content, "stop_reason": stop,
                "stop_sequence": stop_seq,
                # Anthropic: input_tokens + cache_read_input_tokens + cache_creation_input_tokens
                # is the whole prompt, so the prefix-cache hits are not counted twice
                "usage": {"input_tokens": self.input_tokens - cached, "output_tokens": output_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}}

    def build(self, outs: list[Any]) -> dict[str, Any]:
        co = outs[-1].outputs[0]
        cached = int(getattr(outs[-1], "num_cached_tokens", 0) or 0)
        parser = self.setup.new_parser()
        content: list[dict[str, Any]] = []
        if parser.active:
            parsed = parser.parse(co.text)
            if parsed.reasoning:
                content.append({"type": "thinking", "thinking": parsed.reasoning,
                                "signature": ""})
            if parsed.content:
                content.append({"type": "text", "text": parsed.content})
            for c in parsed.tool_calls:
                content.append({"type": "tool_use", "id": tool_use_id(c.id), "name": c.function.name,
                                "input": _tool_input(c.function.arguments)})
            called = bool(parsed.tool_calls)
        else:
            if co.text:  # an empty reply is content [] (as streamed: no block opened)
                content.append({"type": "text", "text": co.text})
            called = False
        stop, seq = self._stop(co, called)
        return self._message(content, stop, seq, len(co.token_ids), cached)

    def stream(self, merged: Any) -> AsyncIterator[str]:
        parser = self.setup.new_parser()
        blocks: list[str] = []  # the type of each block opened so far
        open_idx: Optional[int] = None
        call_blocks: dict[int, int] = {}
        tally = OutputTally(parser)

        def ev(etype: str, **fields: Any) -> str:
            data = json.dumps({"type": etype, **fields}, ensure_ascii=False,
                              separators=(",", ":"))
            return f"event: {etype}\ndata: {data}\n\n"

        def close() -> list[str]:
            nonlocal open_idx
            if open_idx is None:
                return []
            evs = []
            if blocks[open_idx] == "thinking":
                evs.append(ev("content_block_delta", index=open_idx,
                              delta={"type": "signature_delta", "signature": ""}))
            evs.append(ev("content_block_stop", index=open_idx))
            open_idx = None
            return evs

        def open_(block: dict[str, Any]) -> list[str]:
            nonlocal open_idx
            evs = close()
            blocks.append(block["type"])
            open_idx = len(blocks) - 1
            evs.append(ev("content_block_start", index=open_idx, content_block=block))
            return evs

        def on_delta(d: OutputDelta) -> list[str]:
            evs: list[str] = []
            if d.reasoning:
                if open_idx is None or blocks[open_idx] != "thinking":
                    evs += open_({"type": "thinking", "thinking": "", "signature": ""})
                evs.append(ev("content_block_delta", index=open_idx,
                              delta={"type": "thinking_delta", "thinking": d.reasoning}))
            if d.content:
                if open_idx is None or blocks[open_idx] != "text":
                    evs += open_({"type": "text", "text": ""})
                evs.append(ev("content_block_delta", index=open_idx,
                              delta={"type": "text_delta", "text": d.content}))
            for tc in d.tool_calls:
                if tc.id is not None:
                    evs += open_({"type": "tool_use", "id": tool_use_id(tc.id), "name": tc.function.name,
                                  "input": {}})
                    call_blocks[tc.index] = open_idx
                frag = tc.function.arguments if tc.function is not None else None
                if frag and tc.index in call_blocks:
                    evs.append(ev("content_block_delta", index=call_blocks[tc.index],
                                  delta={"type": "input_json_delta", "partial_json": frag}))
            return evs

        def start() -> Iterator[str]:
            # the prompt tokens read from the prefix cache are known once the first output is in
            # (the stream is primed), so message_start and message_delta report the same count
            first = merged.first_output()
            cached = int(getattr(first, "num_cached_tokens", 0) or 0) if first is not None else 0
            yield ev("message_start", message=self._message([], None, None, 0, cached))
            yield ev("ping")

        def on_result(_: int, res: Any) -> Iterator[str]:
            for d in tally.feed(res):
                yield from on_delta(d)

        def on_end(_: bool) -> Iterator[str]:
            yield from close()
            if tally.last is None:  # cut short (server shutdown)
                stop, seq = "end_turn", None
            else:
                stop, seq = self._stop(tally.last, parser.tools_called)
            yield ev("message_delta", delta={"stop_reason": stop, "stop_sequence": seq},
                     usage={"output_tokens": tally.num_tokens, "input_tokens": self.input_tokens - tally.cached,
                            "cache_read_input_tokens": tally.cached})
            yield ev("message_stop")

        def on_error(e: Exception) -> Iterator[str]:
            logger.error("error in messages stream %s", self.msg_id, exc_info=e)
            msg = e.message if isinstance(e, OpenAIError) else f"{type(e).__name__}: {e}"
            yield ev("error", error={"type": "api_error", "message": msg})

        return self.chat.stream_results(merged, [self.msg_id], start=start, on_result=on_result,
                                        on_end=on_end, on_error=on_error)


def build_messages_router(serving: AnthropicServingMessages) -> APIRouter:
    """``POST /v1/messages`` (an Anthropic 400 body on a pooling model) and ``POST
    /v1/messages/count_tokens``."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def create_message(raw_request: Request):
        if serving.chat.engine.runner != "generate":
            return JSONResponse(anthropic_error_body(
                "This model does not support text generation.", 400), status_code=400)
        return await serving.handle(raw_request)

    @router.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw_request: Request):
        return await serving.handle(raw_request, count_only=True)

    return router
