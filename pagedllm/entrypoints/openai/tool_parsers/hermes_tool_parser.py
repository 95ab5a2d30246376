"""``hermes``: Hermes 2 Pro style calls, one JSON object per ``<tool_call>`` block.

Output format (NousResearch Hermes-2-Pro / Hermes 3, Qwen 2.5 / Qwen 3 instruct, QwQ, SmolLM3,
and the SmolLM2 template shipped in ``chat_templates/``)::

    optional text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...
    </tool_call>

A last block without ``</tool_call>`` (the output ended) still counts when its JSON is complete.
"""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParse, ToolParser, ToolParserManager, call_from_object, partial_call_from_json, scan_tagged_calls)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    start_token = "<tool_call>"
    end_token = "</tool_call>"
    markers = (start_token, end_token)

    def parse(self, text: str, final: bool) -> ToolParse:
        def call(body: str, start: int, closed: bool):
            if closed or final:
                return call_from_object(json.loads(body))
            return self.partial(start, body, partial_call_from_json)

        return scan_tagged_calls(text, final, self.start_token, self.end_token, call)
