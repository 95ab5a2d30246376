"""POST /v1/completions (vLLM's serving_completion, simplified)."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.input_processor import ProcessedPrompt
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, value_error_to_openai
from pagedllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest,
                                                  CompletionResponse, CompletionResponseChoice,
                                                  CompletionResponseStreamChoice,
                                                  CompletionStreamResponse, PromptTokenUsageInfo,
                                                  UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, ClientDisconnected,
                                                        OpenAIServing, SSEResponse, base_request_id,
                                                        decoded_token, lp_value, record_request_id,
                                                        sse)

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
        p = request.prompt
        if isinstance(p, str):
            items: list = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise OpenAIError("The prompt cannot be empty.", 400, "prompt")
        out = []
        for item in items:
            prompt = item if isinstance(item, str) else {"prompt_token_ids": list(item)}
            pp = self.process_prompt(prompt, truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     add_special_tokens=request.add_special_tokens)
            out.append((pp.prompt if isinstance(item, str) else None, pp.prompt_token_ids))
        return out

    async def create_completion(self, request: CompletionRequest,
                                raw_request: Optional[Request] = None) -> Response:
        self.check_model(request.model)
        request_id = f"cmpl-{base_request_id(raw_request, request.request_id)}"
        record_request_id(raw_request, request_id)
        created = int(time.time())
        model_name = self.response_model_name(request.model)
        prompts = self._normalize_prompts(request)

        engine_requests, rids, prompt_texts = [], [], []
        for i, (text, ids) in enumerate(prompts):
            try:
                sp = request.to_sampling_params(self.max_model_len - len(ids), self.max_model_len,
                                                self.default_sampling_params)
            except ValueError as e:
                raise value_error_to_openai(e) from e
            rid = f"{request_id}-{i}"
            req = self.process_inputs(rid, ProcessedPrompt(text, ids), sp, cache_salt=request.cache_salt,
                                      lora_request=self.lora_request(request.model))
            self.log_request(rid, text if text is not None else ids, ids, req.sampling_params)
            engine_requests.append(req)
            rids.append(rid)
            prompt_texts.append(text if text is not None else self.tokenizer.decode(ids))

        try:
            if request.use_beam_search:  # vLLM's extra field: n is the beam width
                merged = await self.start_beam_search(engine_requests, request.length_penalty,
                                                      prime=bool(request.stream))
            else:
                merged = await self.start(engine_requests, prime=bool(request.stream))
        except ValueError as e:
            raise value_error_to_openai(e) from e

        if request.stream:
            gen = self._stream(request, merged, rids, request_id, created, model_name, prompts,
                               prompt_texts)
            return SSEResponse(gen)
        try:
            results = await self.collect(merged, raw_request, rids)
        except ClientDisconnected:
            return Response(status_code=499)
        except ValueError as e:
            raise value_error_to_openai(e) from e
        resp = self._build_response(request, results, request_id, created, model_name, prompts,
                                    prompt_texts)
        return JSONResponse(resp.model_dump(mode="json"))

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
            # Latest state per sample; text/token_ids/logprobs accumulated across outputs (works
            # for FINAL_ONLY, CUMULATIVE-final and DELTA streams alike).
            final: dict[int, dict[str, Any]] = {}
            prompt_logprobs = None
            for ro in outs:
                if ro.prompt_token_ids:
                    prompt_ids = list(ro.prompt_token_ids)
                if ro.prompt_logprobs is not None:
                    prompt_logprobs = ro.prompt_logprobs
                for co in ro.outputs:
                    st = final.setdefault(co.index, {"text": "", "token_ids": [], "logprobs": None,
                                                     "finish_reason": None, "stop_reason": None})
                    st["text"] = co.text
                    st["token_ids"] = list(co.token_ids)
                    st["logprobs"] = co.logprobs
                    st["finish_reason"] = co.finish_reason
                    st["stop_reason"] = co.stop_reason
            if outs:
                num_cached += int(getattr(outs[-1], "num_cached_tokens", 0) or 0)
            num_prompt_tokens += len(prompt_ids)
            for idx in sorted(final):
                st = final[idx]
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
                                  choices=choices, usage=usage)

    # ---- streaming ---------------------------------------------------------------------
    async def _stream(self, request: CompletionRequest, merged, rids: list[str], request_id: str,
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
        completed = False
        try:
            async for p_idx, res in merged:
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
                    exclude = {"usage"}
                    if include_continuous:
                        pt = num_prompt_tokens[p_idx]
                        chunk.usage = UsageInfo(prompt_tokens=pt,
                                                completion_tokens=previous_num_tokens[i],
                                                total_tokens=pt + previous_num_tokens[i])
                        exclude = set()
                    yield sse(chunk.model_dump_json(exclude=exclude, exclude_none=False))
            if merged._stopping:
                # Server shutdown cut the stream: tell the client, choice by choice (vLLM's "abort").
                for i in range(total):
                    if not finished[i]:
                        finished[i] = True
                        chunk = CompletionStreamResponse(
                            id=request_id, created=created, model=model_name,
                            choices=[CompletionResponseStreamChoice(index=i, text="", finish_reason="abort")])
                        yield sse(chunk.model_dump_json(exclude={"usage"}, exclude_none=False))
            completed = True
            if include_usage:
                pt = sum(num_prompt_tokens)
                ct = sum(previous_num_tokens)
                usage = UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct,
                                  prompt_tokens_details=PromptTokenUsageInfo(
                                      cached_tokens=sum(num_cached)))
                final = CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                 choices=[], usage=usage)
                yield sse(final.model_dump_json())
        except ValueError as e:
            completed = True
            err = value_error_to_openai(e)
            yield sse(err.to_dict())
        except Exception as e:  # engine died mid-stream
            logger.exception("error in completion stream %s", request_id)
            completed = True
            yield sse(error_body(f"Internal server error: {e}", 500))
        finally:
            await self.finish(merged, rids, completed)
        yield SSE_DONE
