"""Tool-calling types of the OpenAI Chat Completions API (OpenAI + vLLM field names).

Requests carry tools as ``{"type": "function", "function": {"name", "description",
"parameters"}}``; responses carry ``tool_calls`` as ``{"id", "type": "function", "function":
{"name", "arguments"}}`` where ``arguments`` is a JSON text (OpenAI's wire format); streamed
chunks carry ``{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}`` fragments.
Source: https://platform.openai.com/docs/api-reference/chat/create (tools, tool_calls).
"""
from __future__ import annotations

import secrets
import string
import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


def random_tool_call_id() -> str:
    """An OpenAI-style tool call id (vLLM's ``chatcmpl-tool-<32 hex>``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_ALNUM = string.ascii_letters + string.digits


def random_alnum_id(length: int = 9) -> str:
    """A random alphanumeric id (Mistral's chat templates require 9 characters)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(length))


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Model):
    """A complete call: ``arguments`` is the JSON text of the arguments object."""

    name: str
    arguments: str


class ToolCall(_Model):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Model):
    """One streamed fragment of the ``index``-th call: the first fragment has ``id``,
    ``type`` and ``function.name``; the later ones only ``function.arguments`` text, and the
    fragments' ``arguments`` concatenate to the complete call's ``arguments``."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
        if self.type is not None:
            d["type"] = self.type
        if self.function is not None:
            d["function"] = self.function.model_dump(exclude_none=True)
        return d


class ExtractedToolCallInformation(_Model):
    """What a tool parser found in a complete output (vLLM's name and fields).

    Attributes:
        tools_called: True when at least one well-formed call was found.
        tool_calls: the calls, in output order.
        content: the text outside the calls (None when there is none).
    """

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: Optional[str] = None


class FunctionDefinition(_Model):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction
