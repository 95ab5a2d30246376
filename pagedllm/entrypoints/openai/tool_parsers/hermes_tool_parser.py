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
    ToolParse, ToolParser, ToolParserManager, call_from_object, held_marker_prefix,
    partial_call_from_json)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    start_token = "<tool_call>"
    end_token = "</tool_call>"
    markers = (start_token, end_token)

    def parse(self, text: str, final: bool) -> ToolParse:
        content: list[str] = []
        calls = []
        pos = 0
        while True:
            s = text.find(self.start_token, pos)
            if s < 0:
                rest = text[pos:]
                if not final:
                    rest = rest[: len(rest) - held_marker_prefix(rest, (self.start_token,))]
                content.append(rest)
                break
            content.append(text[pos:s])
            body_start = s + len(self.start_token)
            e = text.find(self.end_token, body_start)
            if e < 0:
                body = text[body_start:]
                if final:
                    calls.append(call_from_object(json.loads(body)))
                else:
                    body = body[: len(body) - held_marker_prefix(body, (self.end_token,))]
                    calls.append(self.partial(s, body, partial_call_from_json))
                break
            calls.append(call_from_object(json.loads(text[body_start:e])))
            pos = e + len(self.end_token)
        return ToolParse("".join(content), calls)
