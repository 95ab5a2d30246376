"""``mistral``: Mistral / Mixtral / Mistral-Nemo / Mistral-Small calls after ``[TOOL_CALLS]``.

Two output formats (``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens; the parser keeps
special tokens in the output text):

- tokenizer versions before v11: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``
- v11 and later: ``[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}``

Tool call ids are 9 alphanumeric characters (Mistral's chat templates refuse any other).
"""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.protocol_tools import random_alnum_id
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PartialToolCall, ToolParse, ToolParser, ToolParserManager, call_from_object,
    held_marker_prefix, partial_json)


def partial_calls_from_array(text: str) -> list[PartialToolCall]:
    """Calls from a prefix of a JSON array of ``{"name", "arguments"}`` objects; every element
    but the last is complete."""
    full = partial_json(text)
    if full is None:
        return []
    if not isinstance(full, list):
        raise ValueError("expected a JSON array of tool calls")
    done = partial_json(text, complete_strings_only=True) or []
    calls = [call_from_object(obj) for obj in full[:-1]]
    if full:
        last = full[-1]
        if not isinstance(last, dict):
            raise ValueError("a tool call must be a JSON object")
        d = done[len(full) - 1] if len(done) >= len(full) and isinstance(done[len(full) - 1],
                                                                           dict) else {}
        name = d.get("name")
        args = last.get("arguments", last.get("parameters"))
        calls.append(PartialToolCall(name=name if isinstance(name, str) and name else None,
                                     arguments=args if isinstance(args, dict) else None))
    return calls


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"
    markers = (bot_token, args_token)

    def make_tool_call_id(self) -> str:
        return random_alnum_id(9)

    def parse(self, text: str, final: bool) -> ToolParse:
        s = text.find(self.bot_token)
        if s < 0:
            if final:
                return ToolParse(text, [])
            return ToolParse(text[: len(text) - held_marker_prefix(text, (self.bot_token,))], [])
        content = text[:s]
        rest = text[s + len(self.bot_token):]
        r = rest.lstrip()
        if r.startswith("["):
            if final:
                arr = json.loads(r)
                if not isinstance(arr, list):
                    raise ValueError("expected a JSON array of tool calls")
                return ToolParse(content, [call_from_object(o) for o in arr])
            try:
                arr = json.loads(r)
            except json.JSONDecodeError:
                return ToolParse(content, self.partial("array", r, partial_calls_from_array))
            return ToolParse(content, [call_from_object(o) for o in arr])
        if not r:
            if final:
                raise ValueError("[TOOL_CALLS] without calls")
            return ToolParse(content, [])
        # v11+: name[ARGS]{json}, repeated after [TOOL_CALLS]
        segments = rest.split(self.bot_token)
        calls = []
        for k, seg in enumerate(segments):
            last = k == len(segments) - 1
            a = seg.find(self.args_token)
            if a < 0:
                if final:
                    raise ValueError("a [TOOL_CALLS] call without [ARGS]")
                calls.append(PartialToolCall())
                break
            name = seg[:a].strip()
            body = seg[a + len(self.args_token):]
            if not last or final:
                obj = json.loads(body)
                calls.append(call_from_object({"name": name, "arguments": obj}))
            else:
                value = self.partial(k, body, partial_json)
                calls.append(PartialToolCall(name=name or None,
                                             arguments=value if isinstance(value, dict) else None))
        return ToolParse(content, calls)
