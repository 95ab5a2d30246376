"""Request model and output builders of the OpenAI Responses API (``POST /v1/responses``).

Source: https://platform.openai.com/docs/api-reference/responses (field names, defaults,
item and event shapes); vLLM's extras (``request_id``, ``cache_salt``, sampling fields such
as ``top_k`` / ``seed``, ``chat_template_kwargs``) are accepted too. Input items and output
items stay plain dicts (their shapes are checked by ``serving_responses``); the tests validate
everything the server sends with the openai SDK's own types.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel


def new_id(prefix: str) -> str:
    """An id like OpenAI's: ``resp_…``, ``msg_…``, ``fc_…``, ``call_…``, ``rs_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIBaseModel):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: Optional[bool] = True
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    stream: Optional[bool] = False
    background: Optional[bool] = False
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    top_logprobs: Optional[int] = None
    include: Optional[list[str]] = None
    max_tool_calls: Optional[int] = None
    service_tier: Optional[str] = "auto"

    # vLLM extras
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check(self):
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("`max_output_tokens` must be at least 1.")
        if self.background and not self.store:
            raise ValueError("`background` can only be used when `store` is true.")
        if self.background and self.stream:
            raise ValueError("`background` with `stream` is not supported.")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise ValueError("`input` must not be empty.")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError("`top_logprobs` must be between 0 and 20.")
        if getattr(self, "prompt", None) is not None:
            raise ValueError("`prompt` (stored prompt templates) is not supported.")
        return self


def usage_dict(input_tokens: int, output_tokens: int, cached: int = 0,
               reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            # cache_write_tokens: not tracked by the prefix cache; reported as 0
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text_part(text)] if status != "in_progress" else []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_dict(request: ResponsesRequest, response_id: str, model: str, created_at: int,
                  status: str, output: list[dict[str, Any]], usage: Optional[dict] = None,
                  incomplete_reason: Optional[str] = None,
                  error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The ``response`` object (what the request asked for, echoed, plus the result)."""
    text = request.text or {"format": {"type": "text"}}
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status, "background": bool(request.background),
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls, "model": model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": request.reasoning or {"effort": None, "summary": None},
        "service_tier": request.service_tier or "auto", "store": request.store is not False,
        "temperature": request.temperature, "text": text,
        "tool_choice": request.tool_choice, "tools": request.tools,
        "top_logprobs": request.top_logprobs, "top_p": request.top_p,
        "truncation": request.truncation or "disabled", "usage": usage, "user": request.user,
        "metadata": request.metadata or {},
    }
