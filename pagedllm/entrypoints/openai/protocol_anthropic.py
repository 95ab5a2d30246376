"""Request model and error body of the Anthropic Messages API (``POST /v1/messages``).

Source: https://docs.anthropic.com/en/api/messages (fields, content blocks, tool_choice, stop
reasons, streaming events) and https://docs.anthropic.com/en/api/errors (error body
``{"type": "error", "error": {"type": ..., "message": ...}}``). Content blocks stay plain
dicts; ``serving_messages`` checks them.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel

# HTTP status -> Anthropic error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(message: str, status_code: int) -> dict[str, Any]:
    etype = _ERROR_TYPES.get(status_code, "api_error" if status_code >= 500
                             else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": message}}


class AnthropicMessagesRequest(OpenAIBaseModel):
    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        if not self.messages:
            raise ValueError("messages: at least one message is required")
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise ValueError("temperature: must be between 0 and 1")
        return self
