"""Parsers for outputs constrained by ``tool_choice`` (not registered: chosen by the request).

- ``tool_choice: "required"``: the output is a JSON array ``[{"name": ..., "parameters":
  {...}}, ...]`` (vLLM's schema, see ``tool_choice.required_tool_schema``).
- a named function: the output is that function's arguments object itself; the
  ``arguments`` reported are the output text exactly.
"""
from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PartialToolCall, ToolParse, ToolParser, call_from_object)
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import partial_calls_from_array

_KEYS = ("parameters", "arguments")


class RequiredToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ToolParse:
        if final:
            arr = json.loads(text)
            if not isinstance(arr, list):
                raise ValueError("expected a JSON array of tool calls")
            return ToolParse("", [call_from_object(o, _KEYS) for o in arr])
        return ToolParse("", self.partial("array", text, partial_calls_from_array))


class NamedToolParser(ToolParser):
    def __init__(self, tokenizer: Any, name: str):
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, final: bool) -> ToolParse:
        return ToolParse("", [PartialToolCall(name=self.name, arguments_text=text,
                                              complete=final)])
