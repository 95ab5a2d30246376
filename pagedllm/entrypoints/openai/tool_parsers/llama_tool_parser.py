"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON calls (also ``llama4_json``).

Output format (the whole output is the calls; ``<|python_tag|>`` is optional)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

``parameters`` may also be spelled ``arguments``. An output that does not start with ``{`` or
the tag is plain content.
"""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParse, ToolParser, ToolParserManager, call_from_object, partial_call_from_json)


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"
    markers = (bot_token,)

    def parse(self, text: str, final: bool) -> ToolParse:
        stripped = text.lstrip()
        if stripped.startswith(self.bot_token):
            body = stripped[len(self.bot_token):]
        elif stripped.startswith("{"):
            body = stripped
        elif not final and self.bot_token.startswith(stripped):
            return ToolParse("", [])  # empty so far, or a partial <|python_tag|>: undecided
        else:
            return ToolParse(text, [])
        decoder = json.JSONDecoder()
        calls = []
        i = 0
        while True:
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
            if i >= len(body):
                break
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                if final:
                    raise
                calls.append(self.partial(i, body[i:], partial_call_from_json))
                break
            calls.append(call_from_object(obj))
            i = end
        return ToolParse("", calls)
