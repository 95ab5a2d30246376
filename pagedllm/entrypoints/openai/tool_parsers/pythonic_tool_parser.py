"""``pythonic``: calls written as a Python list of function calls (also ``llama4_pythonic``).

Output format (Llama 3.2 / Llama 4 with the pythonic templates, ToolACE, xLAM-style
models)::

    [get_weather(city='Paris', unit="celsius"), get_time(zone='CET')]

optionally wrapped in ``<|python_start|>`` ... ``<|python_end|>`` (Llama 4). Arguments must be
keyword arguments with Python literal values (strings, numbers, True/False/None, lists,
dicts); they are parsed with ``ast`` and reported as JSON. While streaming, a call's name is
reported as soon as ``name(`` is seen and its arguments once its closing parenthesis is.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PartialToolCall, ToolParse, ToolParser, ToolParserManager)

_NAME_OPEN = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("a pythonic tool call must call a (dotted) name")


def _call_from_node(node: ast.AST) -> PartialToolCall:
    if not isinstance(node, ast.Call):
        raise ValueError("the list must contain only function calls")
    if node.args:
        raise ValueError("pythonic tool calls take keyword arguments only")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs is not allowed in a tool call")
        args[kw.arg] = ast.literal_eval(kw.value)
    json.dumps(args)  # only JSON-representable values (TypeError otherwise)
    return PartialToolCall(name=_dotted_name(node.func), arguments=args, complete=True)


def _split_top_level(s: str) -> tuple[list[str], bool]:
    """Split the inside of a Python list at its top-level commas.

    Returns:
        (elements, closed): the element texts seen so far (the last one possibly
        unfinished) and whether the list's closing ``]`` was reached.
    """
    elems: list[str] = []
    depth = 0
    quote: Optional[str] = None
    start = 0
    i = 0
    while i < len(s):
        c = s[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if s.startswith(quote, i):
                i += len(quote)
                quote = None
                continue
        elif c in "'\"":
            quote = s[i:i + 3] if s[i:i + 3] in ("'''", '"""') else c
            i += len(quote)
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                elems.append(s[start:i])
                return elems, True
            depth -= 1
        elif c == "," and depth == 0:
            elems.append(s[start:i])
            start = i + 1
        i += 1
    elems.append(s[start:])
    return elems, False


@ToolParserManager.register_module(["pythonic", "llama4_pythonic"])
class PythonicToolParser(ToolParser):
    start_token = "<|python_start|>"
    end_token = "<|python_end|>"
    markers = (start_token, end_token)

    def _body(self, text: str) -> str:
        t = text.strip()
        if t.startswith(self.start_token):
            t = t[len(self.start_token):]
            e = t.find(self.end_token)
            if e >= 0:
                t = t[:e]
        return t.strip()

    def parse(self, text: str, final: bool) -> ToolParse:
        t = self._body(text)
        if not t.startswith("["):
            if not final and (self.start_token.startswith(t) or t == self.start_token):
                return ToolParse("", [])
            return ToolParse(text, [])
        if final:
            tree = ast.parse(t, mode="eval")
            if not isinstance(tree.body, ast.List) or not tree.body.elts:
                raise ValueError("expected a non-empty list of calls")
            return ToolParse("", [_call_from_node(e) for e in tree.body.elts])
        elems, closed = _split_top_level(t[1:])
        calls = []
        for k, e in enumerate(elems):
            if k < len(elems) - 1 or closed:
                if not e.strip() and k == len(elems) - 1:
                    break  # a trailing comma
                calls.append(_call_from_node(ast.parse(e.strip(), mode="eval").body))
            else:
                m = _NAME_OPEN.match(e)
                if m:
                    calls.append(PartialToolCall(name=m.group(1)))
                elif e.strip() and not re.fullmatch(r"\s*[A-Za-z_][\w.]*\s*", e):
                    raise ValueError("not a function call")
        return ToolParse("", calls)
