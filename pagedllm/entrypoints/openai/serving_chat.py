"""POST /v1/chat/completions (vLLM's serving_chat, text only)."""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import OpenAIError, value_error_to_openai
from pagedllm.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                  ChatCompletionLogProbsContent,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionResponseChoice,
                                                  ChatCompletionResponseStreamChoice,
                                                  ChatCompletionStreamResponse, ChatMessage,
                                                  ChatMessageParam, DeltaMessage,
                                                  PromptTokenUsageInfo, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, ResponseBuilder, decoded_token, lp_value, require_generate_runner, sse, stream_error_body, abort_unfinished, final_outputs)
from pagedllm.entrypoints.openai.output_parser import OutputParser
from pagedllm.entrypoints.openai.tool_calling import (AUTO_TOOL_CHOICE_FLAGS_MESSAGE, ToolChoice,
                                                      constrain_to_json, forced_tool_schema,
                                                      resolve_tool_choice, validate_tools)

logger = logging.getLogger("pagedllm.entrypoints.openai")


def messages_to_dicts(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """Messages as plain dicts for ``pagedllm.engine.chat.render_chat`` (which joins content
    parts into a string)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.reasoning is not None:
            d["reasoning"] = m.reasoning
        out.append(d)
    return out


def render_chat(serving: OpenAIServing, messages: list[ChatMessageParam], *,
                add_generation_prompt: bool, continue_final_message: bool,
                chat_template: Optional[str], chat_template_kwargs: Optional[dict],
                tools: Optional[list] = None, documents: Optional[list] = None) -> str:
    """Apply the chat template (request template > server --chat-template > tokenizer's) with
    ``pagedllm.engine.chat.render_chat``, the renderer ``LLM.chat`` uses.

    Raises:
        OpenAIError: 400 (param "messages", or "chat_template" when the model has none).
    """
    from pagedllm.engine.chat import render_chat as render
    from pagedllm.multimodal.processing import image_collector

    try:
        # NOTE: image parts (image_url, ...) are decoded here; the result then carries them
        # (engine.chat.ChatPrompt) to the input processor
        return render(serving.tokenizer, messages_to_dicts(messages),
                      chat_template=chat_template or serving.chat_template,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message,
                      chat_template_kwargs=chat_template_kwargs, tools=tools, documents=documents,
                      images=image_collector(serving.input_processor))
    except ValueError as e:
        raise value_error_to_openai(e, "messages") from e


class ChatToolSetup:
    """A request's tools (checked), its resolved tool choice and the per-choice parser factory."""

    def __init__(self, serving: "OpenAIServingChat", tools: list[dict[str, Any]],
                 choice: ToolChoice, parallel: bool, include_reasoning: bool):
        self.serving = serving
        self.tools = tools
        self.choice = choice
        self.parallel = parallel
        self.include_reasoning = include_reasoning

    def new_parser(self) -> OutputParser:
        s = self.serving
        return OutputParser.for_request(
            s.tokenizer, self.choice, self.tools,
            s.tool_parser_cls if s.enable_auto_tools else None, s.reasoning_parser_cls,
            parallel_tool_calls=self.parallel, include_reasoning=self.include_reasoning)


class OpenAIServingChat(OpenAIServing):
    """Chat completions; ``enable_auto_tools`` / ``tool_parser`` / ``reasoning_parser`` are the
    ``--enable-auto-tool-choice`` / ``--tool-call-parser`` / ``--reasoning-parser`` settings
    (parser classes from the tool-parser and reasoning-parser registries, or None)."""

    response_role = "assistant"

    def __init__(self, *args: Any, enable_auto_tools: bool = False,
                 tool_parser: Optional[type] = None, reasoning_parser: Optional[type] = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.enable_auto_tools = bool(enable_auto_tools)
        self.tool_parser_cls = tool_parser
        self.reasoning_parser_cls = reasoning_parser

    def setup_tools(self, request: ChatCompletionRequest) -> ChatToolSetup:
        """Check ``tools`` / ``tool_choice`` (OpenAIError 400 on bad input or "auto" without
        a parser) and adapt the request to the parser (special tokens kept when its markers
        are special tokens)."""
        tools = validate_tools(request.tools) if request.tools else []
        choice = resolve_tool_choice(request.tool_choice, tools,
                                     "tool_choice" in request.model_fields_set)
        if choice.mode == "auto" and not (self.enable_auto_tools and self.tool_parser_cls):
            raise OpenAIError(AUTO_TOOL_CHOICE_FLAGS_MESSAGE, 400, "tool_choice")
        if choice.mode == "auto":
            self.tool_parser_cls(self.tokenizer).adjust_request(request)
        parallel = request.parallel_tool_calls is not False
        include_reasoning = getattr(request, "include_reasoning", True) is not False
        return ChatToolSetup(self, tools, choice, parallel, include_reasoning)

    def render_request(self, request: ChatCompletionRequest, param: str = "messages") -> tuple[ChatToolSetup, Any]:
        """The request's tool set-up and its prompt: ``request.messages`` through the chat
        template with the request's template options and the tools the set-up keeps (the
        Anthropic messages and Responses endpoints render their translated chat request here).

        Raises:
            OpenAIError: 400 for bad tools, or for a template error (param ``param``).
        """
        setup = self.setup_tools(request)
        try:
            prompt_text = render_chat(
                self, request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                tools=setup.tools or None,
                documents=request.documents)
        except ValueError as e:
            raise value_error_to_openai(e, param) from e
        return setup, prompt_text

    def constrain_for_tools(self, sp: Any, setup: ChatToolSetup) -> None:
        """A forced tool choice constrains the output to its JSON schema."""
        schema = forced_tool_schema(setup.choice, setup.tools, setup.parallel)
        if schema is not None:
            constrain_to_json(sp, schema, "tool_choice", source="tools")

    def get_role(self, request: ChatCompletionRequest) -> str:
        if request.add_generation_prompt:
            return self.response_role
        return request.messages[-1].role

    def create_logprobs(self, token_ids: list[int], top_logprobs: Optional[list],
                        num_top: Optional[int], as_token_id: bool = False) -> ChatCompletionLogProbs:
        tok = self.tokenizer
        content: list[ChatCompletionLogProbsContent] = []
        for i, token_id in enumerate(token_ids):
            step = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else None
            if step is None or step.get(token_id) is None:
                token = decoded_token(tok, token_id, None, as_token_id)
                content.append(ChatCompletionLogProbsContent(
                    token=token, bytes=list(token.encode("utf-8", errors="replace"))))
                continue
            st = step[token_id]
            token = decoded_token(tok, token_id, st, as_token_id)
            tops: list[ChatCompletionLogProb] = []
            if num_top:
                ranked = sorted(step.items(), key=lambda kv: (
                    getattr(kv[1], "rank", None) is None, getattr(kv[1], "rank", 0) or 0))
                for tid, lp in ranked[:num_top]:
                    t = decoded_token(tok, tid, lp, as_token_id)
                    tops.append(ChatCompletionLogProb(token=t, logprob=lp_value(lp),
                                                      bytes=list(t.encode("utf-8", errors="replace"))))
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=lp_value(st),
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=tops))
        return ChatCompletionLogProbs(content=content)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Optional[Request] = None) -> Response:
        request_id, created, model_name = self.begin_request(request, raw_request, "chatcmpl")
        setup, prompt_text = self.render_request(request)
        # NOTE: the engine's field names as this endpoint calls them.
        rename = {"prompt": "messages", "logprobs": "top_logprobs",
                  "max_tokens": ("max_completion_tokens" if request.max_completion_tokens is not None
                                 else "max_tokens")}
        pp = self.process_prompt(prompt_text, truncate_prompt_tokens=request.truncate_prompt_tokens,
                                 add_special_tokens=request.add_special_tokens, rename=rename)
        ids = pp.prompt_token_ids
        engine_request = self.prepare(request_id, pp, request, constrain=lambda sp: self.constrain_for_tools(sp, setup),
                                      model=request.model, cache_salt=request.cache_salt, rename=rename,
                                      priority=request.priority, raw_request=raw_request)
        builder = ResponseBuilder(
            stream=lambda merged: self._stream(request, merged, [request_id], request_id, created, model_name,
                                               ids, setup=setup),
            build=lambda results: self._build_response(request, results[0], request_id, created, model_name,
                                                       ids, setup=setup).model_dump(mode="json"))
        # (use_beam_search: vLLM's extra field; n is the beam width)
        return await self.run([engine_request], bool(request.stream), builder, raw_request,
                              length_penalty=request.length_penalty if request.use_beam_search else None)

    def _echo_text(self, request: ChatCompletionRequest, role: str) -> Optional[str]:
        if request.echo and request.messages and request.messages[-1].role == role:
            return request.messages[-1].text_content() or None
        return None

    def _build_response(self, request: ChatCompletionRequest, outs: list[Any], request_id: str,
                        created: int, model_name: str, prompt_ids: list[int],
                        setup: Optional[ChatToolSetup] = None) -> ChatCompletionResponse:
        role = self.get_role(request)
        prompt_ids, prompt_logprobs, final, num_cached = final_outputs(outs, prompt_ids)
        echo = self._echo_text(request, role)
        as_tid = bool(request.return_tokens_as_token_ids)
        choices = []
        num_generated = 0
        for idx in sorted(final):
            co = final[idx]
            logprobs = None
            if request.logprobs and request.top_logprobs is not None:
                logprobs = self.create_logprobs(list(co.token_ids), co.logprobs,
                                                request.top_logprobs, as_tid)
            text = co.text if echo is None else echo + co.text
            num_generated += len(co.token_ids)
            message = ChatMessage(role=role, content=text)
            finish_reason = co.finish_reason or "stop"
            parser = setup.new_parser() if setup is not None else None
            if parser is not None and parser.active:
                parsed = parser.parse(co.text)
                content = parsed.content
                if echo is not None:
                    content = echo + (content or "")
                message = ChatMessage(role=role, content=content,
                                      reasoning_content=parsed.reasoning,
                                      reasoning=parsed.reasoning,
                                      tool_calls=[c.model_dump() for c in parsed.tool_calls])
                finish_reason = parser.finish_reason(co.finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=idx, message=message, logprobs=logprobs,
                finish_reason=finish_reason, stop_reason=co.stop_reason,
                token_ids=list(co.token_ids) if request.return_token_ids else None))
        pt = len(prompt_ids)
        usage = UsageInfo(prompt_tokens=pt, completion_tokens=num_generated,
                          total_tokens=pt + num_generated,
                          prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached))
        pl = None
        if request.prompt_logprobs is not None and prompt_logprobs is not None:
            from pagedllm.entrypoints.openai.serving_completion import _prompt_logprobs_json
            pl = _prompt_logprobs_json(prompt_logprobs, self.tokenizer)
        return ChatCompletionResponse(
            id=request_id, created=created, model=model_name, choices=choices, usage=usage,
            prompt_logprobs=pl,
            prompt_token_ids=list(prompt_ids) if request.return_token_ids else None,
            kv_transfer_params=self.kv_transfer_response(request, request_id))

    def _stream(self, request: ChatCompletionRequest, merged, rids: list[str],
                request_id: str, created: int, model_name: str,
                prompt_ids: list[int], setup: Optional[ChatToolSetup] = None
                ) -> AsyncIterator[str]:
        n = request.n or 1
        parsers = [setup.new_parser() if setup is not None else None for _ in range(n)]
        previous_num_tokens = [0] * n
        finish_sent = [False] * n
        so = request.stream_options
        include_usage = so is not None and so.wants_usage
        include_continuous = so is not None and so.wants_continuous_usage
        num_prompt_tokens = len(prompt_ids)
        num_cached = 0
        role = self.get_role(request)
        as_tid = bool(request.return_tokens_as_token_ids)

        def chunk_json(choice: ChatCompletionResponseStreamChoice, completion_tokens: int) -> str:
            chunk = ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                 choices=[choice])
            if include_continuous:
                chunk.usage = UsageInfo(prompt_tokens=num_prompt_tokens,
                                        completion_tokens=completion_tokens,
                                        total_tokens=num_prompt_tokens + completion_tokens)
                return chunk.model_dump_json()
            # with include_usage every chunk carries "usage" (null until the last; OpenAI)
            return chunk.model_dump_json(exclude=None if include_usage else {"usage"})

        def start() -> Iterator[str]:
            # First chunk(s): the role, for each choice.
            for i in range(n):
                yield sse(chunk_json(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(role=role, content=""), logprobs=None,
                    finish_reason=None), 0))
            echo = self._echo_text(request, role)
            if echo:
                for i in range(n):
                    yield sse(chunk_json(ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(content=echo), logprobs=None,
                        finish_reason=None), 0))

        def on_result(_: int, res: Any) -> Iterator[str]:
            nonlocal num_prompt_tokens, num_cached
            if res.prompt_token_ids:
                num_prompt_tokens = len(res.prompt_token_ids)
            num_cached = int(getattr(res, "num_cached_tokens", 0) or 0)
            for output in res.outputs:
                i = output.index
                if i >= n or finish_sent[i]:
                    continue
                delta_text = output.text
                if (not delta_text and not output.token_ids and not previous_num_tokens[i]
                        and output.finish_reason is None):
                    continue
                logprobs = None
                if request.logprobs and request.top_logprobs is not None:
                    logprobs = self.create_logprobs(list(output.token_ids), output.logprobs,
                                                    request.top_logprobs, as_tid)
                previous_num_tokens[i] += len(output.token_ids)
                if output.finish_reason is not None:
                    finish_sent[i] = True
                delta = DeltaMessage(content=delta_text)
                finish_reason = output.finish_reason
                parser = parsers[i]
                if parser is not None and parser.active:
                    pd = parser.feed(delta_text, final=output.finish_reason is not None)
                    if not pd and output.finish_reason is None and logprobs is None:
                        continue  # held back (a possible marker): nothing to send yet
                    if finish_reason is not None:
                        finish_reason = parser.finish_reason(finish_reason)
                    # One chunk per tool-call fragment (a call's name, then its arguments,
                    # as OpenAI streams them); text, logprobs and finish_reason ride on the
                    # first / last of them.
                    frags = [[c.to_dict()] for c in pd.tool_calls] or [[]]
                    for k, frag in enumerate(frags):
                        last = k == len(frags) - 1
                        delta = DeltaMessage(
                            content=(pd.content or None) if k == 0 else None,
                            reasoning_content=(pd.reasoning or None) if k == 0 else None,
                            reasoning=(pd.reasoning or None) if k == 0 else None,
                            tool_calls=frag)
                        if last:
                            break
                        yield sse(chunk_json(ChatCompletionResponseStreamChoice(
                            index=i, delta=delta, logprobs=None, finish_reason=None),
                            previous_num_tokens[i]))
                choice = ChatCompletionResponseStreamChoice(
                    index=i, delta=delta, logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason if output.finish_reason else None,
                    token_ids=list(output.token_ids) if request.return_token_ids else None)
                yield sse(chunk_json(choice, previous_num_tokens[i]))

        def on_end(stopping: bool) -> Iterator[str]:
            if stopping:
                yield from abort_unfinished(finish_sent, lambda i: sse(chunk_json(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(content=""), logprobs=None, finish_reason="abort"),
                    previous_num_tokens[i])))
            if include_usage:
                ct = sum(previous_num_tokens)
                final = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[],
                    usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=ct,
                                    total_tokens=num_prompt_tokens + ct,
                                    prompt_tokens_details=PromptTokenUsageInfo(
                                        cached_tokens=num_cached)))
                yield sse(final.model_dump_json())

        def on_error(e: Exception) -> Iterator[str]:
            if not isinstance(e, ValueError):
                logger.error("error in chat stream %s", request_id, exc_info=e)
            yield sse(stream_error_body(e))

        return self.stream_results(merged, rids, start=start, on_result=on_result, on_end=on_end,
                                   on_error=on_error, done=SSE_DONE)


def build_chat_router(serving: OpenAIServingChat) -> APIRouter:
    """``POST /v1/chat/completions``; 400 on a pooling model."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        require_generate_runner(serving.engine)
        return await serving.create_chat_completion(request, raw_request)

    return router
