"""POST /v1/completions (vLLM's serving_completion, simplified)."""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Iterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.input_processor import ProcessedPrompt
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest,
                                                  CompletionResponse, CompletionResponseChoice,
                                                  CompletionResponseStreamChoice,
                                                  CompletionStreamResponse, InfillRequest,
                                                  PromptTokenUsageInfo, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, ResponseBuilder, SSEResponse,
                                                        decoded_token, lp_value, require_generate_runner, sse, stream_error_body, abort_unfinished, final_outputs)

logger = logging.getLogger("pagedllm.entrypoints.openai")


def _prompt_logprobs_json(prompt_logprobs: Optional[list], tokenizer: Any) -> Optional[list]:
    if prompt_logprobs is None:
        return None
    out = []
    for pos in prompt_logprobs:
        if pos is None:
            out.append(None)
            continue
        out.append({int(tid): {"logprob": lp_value(lp), "rank": getattr(lp, "rank", None),
                               "decoded_token": decoded_token(tokenizer, tid, lp)}
                    for tid, lp in pos.items()})
    return out


class OpenAIServingCompletion(OpenAIServing):

    def create_logprobs(self, token_ids: list[int], top_logprobs: Optional[list],
                        num_output_top_logprobs: int, initial_text_offset: int = 0,
                        as_token_id: bool = False) -> CompletionLogProbs:
        """vLLM's _create_completion_logprobs: per token its text, logprob, text offset and a
        {token: logprob} dict of the sampled token plus the top ``num_output_top_logprobs``."""
        tok = self.tokenizer
        out_text_offset: list[int] = []
        out_token_logprobs: list[Optional[float]] = []
        out_tokens: list[str] = []
        out_top: list[Optional[dict[str, float]]] = []
        last_token_len = 0
        for i, token_id in enumerate(token_ids):
            step = top_logprobs[i] if top_logprobs is not None and i < len(top_logprobs) else None
            if step is None or token_id not in step:
                token = decoded_token(tok, token_id, None, as_token_id)
                out_tokens.append(token)
                out_token_logprobs.append(None)
                out_top.append(None)
            else:
                step_token = step[token_id]
                token = decoded_token(tok, token_id, step_token, as_token_id)
                out_tokens.append(token)
                out_token_logprobs.append(lp_value(step_token))
                top: dict[str, float] = {}
                for j, (tid, lp) in enumerate(step.items()):
                    if num_output_top_logprobs >= j:
                        top[decoded_token(tok, tid, lp, as_token_id)] = lp_value(lp)
                out_top.append(top)
            if not out_text_offset:
                out_text_offset.append(initial_text_offset)
            else:
                out_text_offset.append(out_text_offset[-1] + last_token_len)
            last_token_len = len(token)
        return CompletionLogProbs(text_offset=out_text_offset, token_logprobs=out_token_logprobs,
                                  tokens=out_tokens, top_logprobs=out_top)

    def _normalize_prompts(self, request: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
        """``(text or None, token ids)`` per prompt, each through the engine's input path
        (tokenized, checked against the vocabulary, truncated, its length checked).

        Raises:
            OpenAIError: 400 naming the field.
        """
        out: list = []
        if request.prompt_embeds is not None:
            out = self._embeds_prompts(request)
            if request.prompt is None:
                return out
        p = request.prompt
        if isinstance(p, str):
            items: list = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise OpenAIError("The prompt cannot be empty.", 400, "prompt")
        if request.suffix:
            return out + [self._fim_prompt(item, request) for item in items]
        for item in items:
            prompt = item if isinstance(item, str) else {"prompt_token_ids": list(item)}
            pp = self.process_prompt(prompt, truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     add_special_tokens=request.add_special_tokens)
            out.append((pp.prompt if isinstance(item, str) else None, pp.prompt_token_ids, pp))
        return out

    def _embeds_prompts(self, request: CompletionRequest) -> list[tuple[None, list[int], ProcessedPrompt]]:
        """The ``prompt_embeds`` prompts: each base64 of a ``torch.save``'d float tensor
        ``(seq_len, hidden_size)`` (vLLM's encoding; loaded with ``weights_only=True``), checked by
        the input processor (``check_prompt_embeds``) and truncated like a prompt.

        Raises:
            OpenAIError: 400 naming ``prompt_embeds``: prompt embeddings not enabled
                (``--enable-prompt-embeds``), not base64, not a saved tensor, a wrong shape or
                dtype, NaN/inf values, too long; 400 naming ``suffix`` / ``echo`` with them.
        """
        import base64
        import binascii
        import io

        import torch

        if self.input_processor.prompt_embeds_spec is None:
            raise OpenAIError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.", 400,
                              "prompt_embeds")
        if request.suffix:
            raise OpenAIError("suffix: not available with prompt_embeds", 400, "suffix")
        if request.echo:
            raise OpenAIError("echo: not available with prompt_embeds (they have no text)", 400, "echo")
        items = [request.prompt_embeds] if isinstance(request.prompt_embeds, str) else list(request.prompt_embeds)
        if not items:
            raise OpenAIError("prompt_embeds: the list is empty", 400, "prompt_embeds")
        out = []
        for i, b64 in enumerate(items):
            where = "" if len(items) == 1 else f" (item {i})"
            try:
                raw = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise OpenAIError(f"prompt_embeds: not valid base64{where}", 400, "prompt_embeds") from None
            try:
                tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            except Exception as e:  # not a torch.save file, or not only tensors inside
                raise OpenAIError(f"prompt_embeds: not a torch.save'd tensor{where} ({type(e).__name__}: "
                                  f"{str(e)[:200]})", 400, "prompt_embeds") from None
            pp = self.process_prompt({"prompt_embeds": tensor}, truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     rename={"prompt": "prompt_embeds"})
            out.append((None, pp.prompt_token_ids, pp))
        return out

    def _fim_prompt(self, item: Any, request: CompletionRequest) -> tuple[Optional[str], list[int]]:
        """A fill-in-the-middle prompt: ``item`` (a text) before the gap, ``request.suffix``
        after it, laid out with the tokenizer's FIM tokens (``pagedllm.engine.fim``).

        Raises:
            OpenAIError: 400 naming ``suffix`` for a model whose tokenizer has no FIM tokens or a
                prompt given as token ids; the usual prompt errors otherwise.
        """
        from pagedllm.engine.fim import encode_fim, fim_tokens

        if fim_tokens(self.tokenizer) is None:
            raise OpenAIError("suffix: this model does not support fill-in-the-middle (its tokenizer has "
                              "no FIM tokens such as <|fim_prefix|>/<|fim_suffix|>/<|fim_middle|>, "
                              "<fim_prefix>... or \u2581<PRE>...); leave suffix out", 400, "suffix")
        if not isinstance(item, str):
            raise OpenAIError("suffix: a fill-in-the-middle prompt must be text, not token ids", 400, "suffix")
        ids = encode_fim(self.tokenizer, item, request.suffix,
                         add_special_tokens=request.add_special_tokens)
        pp = self.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=request.truncate_prompt_tokens)
        return item, pp.prompt_token_ids, pp

    async def create_completion(self, request: CompletionRequest,
                                raw_request: Optional[Request] = None) -> Response:
        request_id, created, model_name = self.begin_request(request, raw_request, "cmpl")
        prompts = self._normalize_prompts(request)

        engine_requests, rids, prompt_texts = [], [], []
        for i, (text, ids, pp) in enumerate(prompts):
            rid = f"{request_id}-{i}"
            embeds = pp.prompt_embeds is not None
            req = self.prepare(rid, pp if embeds else ProcessedPrompt(text, ids), request, prompt_len=len(ids),
                               model=request.model, cache_salt=request.cache_salt,
                               rename={"prompt": "prompt_embeds"} if embeds else None,
                               priority=request.priority, raw_request=raw_request,
                               log_prompt=(f"<prompt_embeds {tuple(pp.prompt_embeds.shape)}>" if embeds
                                           else text if text is not None else ids))
            engine_requests.append(req)
            rids.append(req.request_id)  # (the engine id: process_inputs may have suffixed a reused one)
            prompt_texts.append("" if embeds else text if text is not None else self.tokenizer.decode(ids))

        builder = ResponseBuilder(
            stream=lambda merged: self._stream(request, merged, rids, request_id, created, model_name, prompts,
                                               prompt_texts),
            build=lambda results: self._build_response(request, results, request_id, created, model_name, prompts,
                                                       prompt_texts).model_dump(mode="json"))
        # (use_beam_search: vLLM's extra field; n is the beam width)
        return await self.run(engine_requests, bool(request.stream), builder, raw_request,
                              length_penalty=request.length_penalty if request.use_beam_search else None)

    # ---- llama.cpp /infill ---------------------------------------------------------------
    async def create_infill(self, request: InfillRequest, raw_request: Optional[Request] = None) -> Response:
        """llama.cpp server's ``POST /infill``: the FIM prompt ``encode_fim(input_prefix,
        input_suffix, middle=prompt, extra=input_extra)`` completed as ``/v1/completions`` would,
        answered in llama.cpp's ``/completion`` shape: ``{"content", "tokens", "stop": true,
        "model", "tokens_predicted", "tokens_evaluated", "stop_type": "eos"|"limit"|"word",
        "stopping_word"}`` (streamed: one ``data: {"content", "stop": false}`` event per piece,
        then the final object with ``"stop": true``).

        Raises:
            OpenAIError: 400 naming ``input_suffix`` for a model without FIM tokens.
        """
        from pagedllm.engine.fim import encode_fim, fim_tokens

        if fim_tokens(self.tokenizer) is None:
            raise OpenAIError("input_suffix: this model does not support fill-in-the-middle (its tokenizer "
                              "has no FIM tokens)", 400, "input_suffix")
        try:
            ids = encode_fim(self.tokenizer, request.input_prefix, request.input_suffix, middle=request.prompt,
                             extra=[c.model_dump() for c in request.input_extra])
        except ValueError as e:
            raise OpenAIError(str(e), 400, "input_extra") from None
        creq = request.to_completion_request(ids)
        resp = await self.create_completion(creq, raw_request)
        model = self.response_model_name(request.model)
        if isinstance(resp, SSEResponse):
            return SSEResponse(self._infill_stream(resp.body_iterator, request, model, len(ids)))
        if resp.status_code != 200:
            return resp
        body = json.loads(resp.body)
        choice = body["choices"][0]
        return JSONResponse(_infill_body(choice.get("text", ""), choice.get("token_ids") or [],
                                         choice.get("finish_reason"), choice.get("stop_reason"), model,
                                         len(ids), request.return_tokens))

    async def _infill_stream(self, chunks: AsyncIterator[str], request: InfillRequest, model: str,
                             n_prompt: int) -> AsyncIterator[str]:
        text, tokens, finish, stop_reason = "", [], None, None
        try:
            async for ev in chunks:
                data = ev.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    yield ev
                    return
                for c in obj.get("choices", []):
                    text += c.get("text", "")
                    tokens += c.get("token_ids") or []
                    finish = c.get("finish_reason") or finish
                    stop_reason = c.get("stop_reason") if c.get("stop_reason") is not None else stop_reason
                    if c.get("text") or c.get("token_ids"):
                        piece = {"content": c.get("text", ""), "stop": False}
                        if request.return_tokens:
                            piece["tokens"] = c.get("token_ids") or []
                        yield sse(piece)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        final = _infill_body("", tokens, finish, stop_reason, model, n_prompt, request.return_tokens)
        final["tokens_predicted"] = len(tokens)
        yield sse(final)

    # ---- non-streaming -----------------------------------------------------------------
    def _build_response(self, request: CompletionRequest, results: dict[int, list[Any]],
                        request_id: str, created: int, model_name: str,
                        prompts: list, prompt_texts: list[str]) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = 0
        num_generated = 0
        num_cached = 0
        echo_only = request.echo and request.max_tokens == 0
        as_tid = bool(request.return_tokens_as_token_ids)
        for p_idx in range(len(prompts)):
            outs = results.get(p_idx, [])
            prompt_ids = prompts[p_idx][1]
            prompt_text = prompt_texts[p_idx]
            # The latest state per sample (the server collects FINAL_ONLY / CUMULATIVE outputs).
            prompt_ids, prompt_logprobs, final, cached = final_outputs(outs, prompt_ids)
            num_cached += cached
            num_prompt_tokens += len(prompt_ids)
            for idx in sorted(final):
                co = final[idx]
                st = {"text": co.text, "token_ids": list(co.token_ids), "logprobs": co.logprobs,
                      "finish_reason": co.finish_reason, "stop_reason": co.stop_reason}
                token_ids = st["token_ids"]
                out_logprobs = st["logprobs"]
                text = st["text"]
                if request.echo:
                    if echo_only:
                        token_ids, out_logprobs, text = list(prompt_ids), prompt_logprobs, prompt_text
                    else:
                        text = prompt_text + text
                        if request.logprobs is not None and prompt_logprobs is not None:
                            out_logprobs = list(prompt_logprobs) + list(out_logprobs or [])
                        else:
                            out_logprobs = None if out_logprobs is None else [None] * len(prompt_ids) + list(out_logprobs)
                        token_ids = list(prompt_ids) + list(token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.create_logprobs(token_ids, out_logprobs, request.logprobs,
                                                    0, as_tid)
                num_generated += len(st["token_ids"]) if not echo_only else 0
                choices.append(CompletionResponseChoice(
                    index=len(choices), text=text, logprobs=logprobs,
                    finish_reason=st["finish_reason"] or "length" if echo_only else st["finish_reason"],
                    stop_reason=st["stop_reason"],
                    prompt_logprobs=(_prompt_logprobs_json(prompt_logprobs, self.tokenizer)
                                     if request.prompt_logprobs is not None else None),
                    token_ids=list(st["token_ids"]) if request.return_token_ids else None,
                    prompt_token_ids=list(prompt_ids) if request.return_token_ids else None,
                ))
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                          total_tokens=num_prompt_tokens + num_generated,
                          prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=num_cached))
        return CompletionResponse(id=request_id, created=created, model=model_name,
                                  choices=choices, usage=usage,
                                  kv_transfer_params=self.kv_transfer_response(request, f"{request_id}-0"))

    # ---- streaming ---------------------------------------------------------------------
    def _stream(self, request: CompletionRequest, merged, rids: list[str], request_id: str,
                created: int, model_name: str, prompts: list,
                prompt_texts: list[str]) -> AsyncIterator[str]:
        num_choices = request.n or 1
        num_prompts = len(prompts)
        total = num_choices * num_prompts
        previous_text_lens = [0] * total
        previous_num_tokens = [0] * total
        has_echoed = [False] * total
        sent_first = [False] * total
        finished = [False] * total
        num_prompt_tokens = [len(p[1]) for p in prompts]
        num_cached = [0] * num_prompts
        so = request.stream_options
        include_usage = so is not None and so.wants_usage
        include_continuous = so is not None and so.wants_continuous_usage
        echo_only = request.echo and request.max_tokens == 0
        as_tid = bool(request.return_tokens_as_token_ids)

        def on_result(p_idx: int, res: Any) -> Iterator[str]:
            if res.prompt_token_ids:
                num_prompt_tokens[p_idx] = len(res.prompt_token_ids)
            num_cached[p_idx] = int(getattr(res, "num_cached_tokens", 0) or 0)
            prompt_ids = prompts[p_idx][1]
            prompt_logprobs = res.prompt_logprobs
            for output in res.outputs:
                i = output.index + p_idx * num_choices
                if finished[i]:
                    continue
                out_logprobs = output.logprobs
                if request.echo and not has_echoed[i]:
                    if echo_only:
                        delta_text = prompt_texts[p_idx]
                        delta_token_ids = list(prompt_ids)
                        out_logprobs = prompt_logprobs
                    else:
                        delta_text = prompt_texts[p_idx] + output.text
                        delta_token_ids = list(prompt_ids) + list(output.token_ids)
                        if request.logprobs is not None and prompt_logprobs is not None:
                            out_logprobs = list(prompt_logprobs) + list(output.logprobs or [])
                        elif out_logprobs is not None:
                            out_logprobs = [None] * len(prompt_ids) + list(out_logprobs)
                    has_echoed[i] = True
                elif echo_only:
                    delta_text, delta_token_ids, out_logprobs = "", [], None
                else:
                    delta_text = output.text
                    delta_token_ids = list(output.token_ids)
                    if (not delta_text and not delta_token_ids and not previous_num_tokens[i]
                            and output.finish_reason is None):
                        continue  # nothing to say yet (e.g. chunked prefill)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.create_logprobs(delta_token_ids, out_logprobs,
                                                    request.logprobs, previous_text_lens[i],
                                                    as_tid)
                previous_text_lens[i] += len(delta_text)
                if not echo_only:
                    previous_num_tokens[i] += len(output.token_ids)
                if output.finish_reason is not None:
                    finished[i] = True
                if echo_only and output.finish_reason is None and not delta_text:
                    continue
                choice = CompletionResponseStreamChoice(
                    index=i, text=delta_text, logprobs=logprobs,
                    finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                    token_ids=list(output.token_ids) if request.return_token_ids else None,
                    prompt_token_ids=(list(prompt_ids) if request.return_token_ids
                                      and not sent_first[i] else None),
                )
                sent_first[i] = True
                chunk = CompletionStreamResponse(id=request_id, created=created,
                                                 model=model_name, choices=[choice])
                # with include_usage every chunk carries "usage" (null until the last; OpenAI)
                exclude = set() if include_usage else {"usage"}
                if include_continuous:
                    pt = num_prompt_tokens[p_idx]
                    chunk.usage = UsageInfo(prompt_tokens=pt,
                                            completion_tokens=previous_num_tokens[i],
                                            total_tokens=pt + previous_num_tokens[i])
                    exclude = set()
                yield sse(chunk.model_dump_json(exclude=exclude, exclude_none=False))

        def on_end(stopping: bool) -> Iterator[str]:
            if stopping:
                yield from abort_unfinished(finished, lambda i: sse(CompletionStreamResponse(
                    id=request_id, created=created, model=model_name,
                    choices=[CompletionResponseStreamChoice(index=i, text="", finish_reason="abort")]
                ).model_dump_json(exclude=set() if include_usage else {"usage"}, exclude_none=False)))
            if include_usage:
                pt = sum(num_prompt_tokens)
                ct = sum(previous_num_tokens)
                usage = UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct,
                                  prompt_tokens_details=PromptTokenUsageInfo(
                                      cached_tokens=sum(num_cached)))
                final = CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                 choices=[], usage=usage)
                yield sse(final.model_dump_json())

        def on_error(e: Exception) -> Iterator[str]:
            if not isinstance(e, ValueError):  # engine died mid-stream
                logger.error("error in completion stream %s", request_id, exc_info=e)
            yield sse(stream_error_body(e))

        return self.stream_results(merged, rids, on_result=on_result, on_end=on_end, on_error=on_error,
                                   done=SSE_DONE)


def _infill_body(text: str, tokens: list[int], finish: Optional[str], stop_reason: Any, model: str,
                 n_prompt: int, return_tokens: bool) -> dict[str, Any]:
    """llama.cpp's final ``/completion`` object for an infill answer."""
    stop_type = {"length": "limit", "stop": "word" if isinstance(stop_reason, str) else "eos"}.get(finish or "", "none")
    return {"content": text, "tokens": list(tokens) if return_tokens else [], "stop": True, "model": model,
            "tokens_predicted": len(tokens), "tokens_evaluated": n_prompt, "stop_type": stop_type,
            "stopping_word": stop_reason if isinstance(stop_reason, str) else "", "truncated": False}


def build_completion_router(serving: OpenAIServingCompletion) -> APIRouter:
    """``POST /v1/completions`` and ``POST /infill`` (llama.cpp server's fill-in-the-middle
    route, for models whose tokenizer has FIM tokens); 400 on a pooling model."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        require_generate_runner(serving.engine)
        return await serving.create_completion(request, raw_request)

    @router.post("/infill")
    async def create_infill(request: InfillRequest, raw_request: Request):
        require_generate_runner(serving.engine)
        return await serving.create_infill(request, raw_request)

    return router
