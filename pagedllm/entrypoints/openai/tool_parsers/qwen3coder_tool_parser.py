"""``qwen3_coder`` / ``qwen3_xml``: Qwen3-Coder's XML-style calls (also Qwen3-Next and
Qwen3.5 templates that use the same format).

Output format::

    optional text
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one leading and one trailing newline removed) converted with
the tool's JSON schema: strings stay strings; integer/number/boolean/null parse as such;
objects and arrays parse as JSON (or Python literals); a parameter missing from the schema
stays a string. While streaming, a string parameter is reported as it grows; other types once
their ``</parameter>`` is seen.
"""
from __future__ import annotations

import ast
import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PartialToolCall, ToolParse, ToolParser, ToolParserManager, held_marker_prefix, scan_tagged_calls)

_FN = "<function="
_FN_END = "</function>"
_P = "<parameter="
_P_END = "</parameter>"
# What may follow a parameter's value (a stream holds back a suffix that may start one).
_VALUE_ENDS = tuple(nl + m for m in (_P_END, _P, _FN_END) for nl in ("\n", ""))


def _schema_type(schema: Optional[dict]) -> str:
    if not isinstance(schema, dict):
        return "string"
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t is None:
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
            return "string"
        if "properties" in schema:
            return "object"
        return "string" if not any(k in schema for k in ("anyOf", "oneOf")) else "any"
    return str(t).lower()


def convert_param(value: str, schema: Optional[dict]) -> Any:
    """A parameter's raw text as the value its schema types it as."""
    t = _schema_type(schema)
    if t in ("string", "str", "text"):
        return value
    v = value.strip()
    if v.lower() in ("null", "none"):
        return None
    try:
        if t in ("integer", "int"):
            return int(v)
        if t in ("number", "float"):
            f = float(v)
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        if t in ("boolean", "bool"):
            if v.lower() in ("true", "false"):
                return v.lower() == "true"
            raise ValueError(v)
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return ast.literal_eval(v)
    except (ValueError, SyntaxError, TypeError):
        return value  # not of the declared type: keep the text (as Qwen's reference parser)


def _strip_one_newline(v: str) -> str:
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


@ToolParserManager.register_module(["qwen3_coder", "qwen3_xml"])
class Qwen3CoderToolParser(ToolParser):
    start_token = "<tool_call>"
    end_token = "</tool_call>"
    markers = (start_token, end_token)

    def _parse_call(self, body: str, complete: bool) -> PartialToolCall:
        b = body.lstrip()
        if not b.startswith(_FN):
            if not complete and _FN.startswith(b):
                return PartialToolCall()
            raise ValueError("a <tool_call> block must start with <function=NAME>")
        gt = b.find(">")
        if gt < 0:
            if complete:
                raise ValueError("unterminated <function=")
            return PartialToolCall()
        name = b[len(_FN):gt].strip()
        if not name:
            raise ValueError("empty function name")
        fn = b[gt + 1:]
        e = fn.find(_FN_END)
        if e >= 0:
            fn, complete = fn[:e], True
        schema = self.tool_schemas.get(name) or {}
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        args: dict[str, Any] = {}
        pos = 0
        while True:
            p = fn.find(_P, pos)
            if p < 0:
                break
            pgt = fn.find(">", p)
            if pgt < 0:
                if complete:
                    raise ValueError("unterminated <parameter=")
                break
            pname = fn[p + len(_P):pgt].strip()
            vstart = pgt + 1
            ends = [x for x in (fn.find(_P_END, vstart), fn.find(_P, vstart)) if x >= 0]
            if ends or complete:
                vend = min(ends) if ends else len(fn)
                args[pname] = convert_param(_strip_one_newline(fn[vstart:vend]),
                                            props.get(pname))
                pos = vend + (len(_P_END) if fn.startswith(_P_END, vend) else 0)
                continue
            # The last parameter, still being written: report it only if it is a string.
            if _schema_type(props.get(pname)) in ("string", "str", "text"):
                v = fn[vstart:]
                v = v[: len(v) - held_marker_prefix(v, _VALUE_ENDS)]
                if v.endswith("\n"):
                    v = v[:-1]
                args[pname] = v[1:] if v.startswith("\n") else v
            break
        return PartialToolCall(name=name, arguments=args, complete=complete)

    def parse(self, text: str, final: bool) -> ToolParse:
        return scan_tagged_calls(text, final, self.start_token, self.end_token,
                                 lambda body, _, closed: self._parse_call(body, complete=closed or final))
