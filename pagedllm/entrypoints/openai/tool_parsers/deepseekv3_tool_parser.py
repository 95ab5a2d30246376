"""``deepseek_v3`` (also ``deepseek_v31``): DeepSeek-V3 / R1-0528 and V3.1 calls.

Output formats (the markers are DeepSeek's special tokens)::

    text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and, for V3.1, ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``
inside the same ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` block.
"""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PartialToolCall, ToolParse, ToolParser, ToolParserManager, call_from_object,
    held_marker_prefix, partial_json)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = "```json\n"
_FENCE_CLOSE = "```"


@ToolParserManager.register_module(["deepseek_v3", "deepseek_v31"])
class DeepSeekV3ToolParser(ToolParser):
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def _call(self, seg: str, complete: bool) -> PartialToolCall:
        sep = seg.find(SEP)
        if sep < 0:
            if complete:
                raise ValueError("a DeepSeek tool call without <｜tool▁sep｜>")
            return PartialToolCall()
        left, right = seg[:sep].strip(), seg[sep + len(SEP):]
        if left == "function":  # V3: name, newline, fenced JSON
            nl = right.find("\n")
            if nl < 0:
                if complete:
                    raise ValueError("a DeepSeek V3 tool call without arguments")
                return PartialToolCall()
            name = right[:nl].strip()
            body = right[nl + 1:]
            if body.startswith("```"):
                body = body[body.find("\n") + 1:] if "\n" in body else ""
            elif not complete and _FENCE_OPEN.startswith(body):
                body = ""
            if complete:
                body = body.rstrip()
                if body.endswith(_FENCE_CLOSE):
                    body = body[: -len(_FENCE_CLOSE)]
            else:
                body = body[: len(body) - held_marker_prefix(body, ("\n" + _FENCE_CLOSE,
                                                                    _FENCE_CLOSE))]
        else:  # V3.1: name<sep>json
            name, body = left, right
        if not name:
            raise ValueError("empty function name")
        if complete:
            return call_from_object({"name": name, "arguments": json.loads(body)})
        value = self.partial(seg[:sep], body, partial_json)
        return PartialToolCall(name=name, arguments=value if isinstance(value, dict) else None)

    def parse(self, text: str, final: bool) -> ToolParse:
        s = text.find(CALLS_BEGIN)
        if s < 0:
            if final:
                return ToolParse(text, [])
            return ToolParse(text[: len(text) - held_marker_prefix(text, (CALLS_BEGIN,))], [])
        content = text[:s]
        rest = text[s + len(CALLS_BEGIN):]
        e = rest.find(CALLS_END)
        if e >= 0:
            content += rest[e + len(CALLS_END):]
            rest = rest[:e]
        calls = []
        pos = 0
        while True:
            b = rest.find(CALL_BEGIN, pos)
            if b < 0:
                break
            ce = rest.find(CALL_END, b)
            if ce < 0:
                seg = rest[b + len(CALL_BEGIN):]
                if not final:
                    seg = seg[: len(seg) - held_marker_prefix(seg, (CALL_END,))]
                calls.append(self._call(seg, complete=final))
                break
            calls.append(self._call(rest[b + len(CALL_BEGIN):ce], complete=True))
            pos = ce + len(CALL_END)
        if final and not calls:
            raise ValueError("<｜tool▁calls▁begin｜> without calls")
        return ToolParse(content, calls)
