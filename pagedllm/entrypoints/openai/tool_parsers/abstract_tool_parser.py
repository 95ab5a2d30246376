"""The tool-call parser interface, its registry, and the streaming driver shared by all parsers.

A parser turns a model's raw text into (content, tool calls). Each parser implements one
method, :meth:`ToolParser.parse` ``(text, final) -> ToolParse``:

- ``final=True`` (the whole output): every call complete, or, when any call is malformed,
  no calls and the whole text as content (vLLM's behaviour: never a crash, never a half call).
- ``final=False`` (a prefix of the output while streaming): the content that is certainly not
  part of a call marker, and the calls seen so far, the last one possibly partial (its name is
  reported only once complete; its arguments as the Python value parsed so far, where only the
  last string may be incomplete and unfinished numbers/literals are left out).

:class:`ToolCallStreamer` diffs successive ``parse`` results into OpenAI ``delta.tool_calls``
fragments: the first fragment of a call carries ``id``, ``type`` and ``function.name``; later ones
extend ``function.arguments`` with text that is guaranteed to be a prefix of the final
arguments (the JSON serialisation of the partial value minus its unfinished tail), so the
fragments concatenate to exactly the non-streamed ``arguments``.

Registry: ``ToolParserManager.register_module("name")`` decorates a class;
``--tool-parser-plugin FILE`` imports a Python file that registers more (vLLM's names).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from partial_json_parser import Allow
from partial_json_parser import loads as _partial_loads

from pagedllm.class_registry import ClassRegistry
from pagedllm.entrypoints.openai.protocol_tools import (DeltaFunctionCall, DeltaToolCall,
                                                        ExtractedToolCallInformation, FunctionCall,
                                                        ToolCall, random_tool_call_id)

logger = logging.getLogger("pagedllm.entrypoints.openai.tool_parsers")

# Partial JSON: an unfinished string is kept (it only grows), unfinished numbers and literals
# are dropped (``1`` may become ``12``, ``tru`` is not a value yet).
_ALLOW_PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR
# The same but unfinished strings dropped too: a key present here has its final value.
_ALLOW_COMPLETE_STRINGS = Allow.OBJ | Allow.ARR


def partial_json(text: str, complete_strings_only: bool = False) -> Any:
    """Parse a JSON prefix with ``partial_json_parser``.

    Returns:
        the value so far (containers closed, see the module docstring), or None for an empty
        or whitespace-only prefix.

    Raises:
        ValueError: the prefix cannot start any valid JSON text (malformed).
    """
    if not text.strip():
        return None
    try:
        return _partial_loads(text, _ALLOW_COMPLETE_STRINGS if complete_strings_only
                              else _ALLOW_PARTIAL)
    except Exception as e:  # MalformedJSON / PartialJSON / json.JSONDecodeError
        raise ValueError(f"malformed JSON: {e}") from e


def stable_json_prefix(value: Any) -> str:
    """The part of ``json.dumps(value)`` that stays a prefix of the final serialisation when
    ``value`` is a partial parse (see the module docstring): the serialisation minus the
    closing quotes/brackets that completion added (and any unpaired surrogate)."""
    s = json.dumps(value, ensure_ascii=False)
    i = len(s)
    while i > 0 and (s[i - 1] in '"]}' or "\ud800" <= s[i - 1] <= "\udfff"):
        i -= 1
    return s[:i]


def held_marker_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``
    (text a stream must hold back: it may be the start of a marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


@dataclass
class PartialToolCall:
    """A tool call as parsed so far.

    Attributes:
        name: the function name, or None until it is complete.
        arguments: the arguments as a Python value (a dict for a JSON object) so far, or None.
        arguments_text: the exact arguments text, for formats whose output is the arguments
            JSON itself (a named tool choice); overrides ``arguments`` when set.
        complete: the call's text is complete (its arguments are final).
    """

    name: Optional[str] = None
    arguments: Any = None
    arguments_text: Optional[str] = None
    complete: bool = False
    _stable: Optional[str] = field(default=None, repr=False, compare=False)

    def final_arguments(self) -> str:
        """The OpenAI ``arguments`` string: the JSON text of the arguments object."""
        if self.arguments_text is not None:
            return self.arguments_text
        return json.dumps(self.arguments if self.arguments is not None else {},
                          ensure_ascii=False)

    def stable_arguments(self) -> str:
        """A prefix of the final ``arguments`` that later text cannot change."""
        if self.complete or self.arguments_text is not None:
            return self.final_arguments()
        if not isinstance(self.arguments, (dict, list)):
            return ""
        if self._stable is None:  # a cached partial parse is asked again until it grows
            self._stable = stable_json_prefix(self.arguments)
        return self._stable


@dataclass
class ToolParse:
    """A parse of an output (or of a prefix of it): the text outside the calls, and the calls."""

    content: str = ""
    calls: list[PartialToolCall] = field(default_factory=list)


def scan_tagged_calls(text: str, final: bool, start_token: str, end_token: str,
                      parse_call: Callable[[str, int, bool], PartialToolCall]) -> ToolParse:
    """Split ``text`` into content and the calls written as ``start_token BODY end_token``
    (Hermes' ``<tool_call>``, Qwen3-Coder's XML calls).

    ``parse_call(body, start, closed)`` makes one call: ``start`` is the offset of its start
    token (a stable key for ``ToolParser.partial``); ``closed`` is False for the last call when
    its end token has not come yet. While ``final`` is False, a trailing prefix of a marker (of
    ``start_token`` after the content, of ``end_token`` in an open call) is held back.
    """
    content: list[str] = []
    calls = []
    pos = 0
    while True:
        s = text.find(start_token, pos)
        if s < 0:
            rest = text[pos:]
            if not final:
                rest = rest[: len(rest) - held_marker_prefix(rest, (start_token,))]
            content.append(rest)
            break
        content.append(text[pos:s])
        body_start = s + len(start_token)
        e = text.find(end_token, body_start)
        if e < 0:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - held_marker_prefix(body, (end_token,))]
            calls.append(parse_call(body, s, False))
            break
        calls.append(parse_call(text[body_start:e], s, True))
        pos = e + len(end_token)
    return ToolParse("".join(content), calls)


def call_from_object(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")
                     ) -> PartialToolCall:
    """A complete call from a decoded ``{"name": str, "arguments": {...}}`` object.

    ``arguments`` may also be given as ``parameters`` (Llama 3) or as a JSON text holding an
    object; it defaults to ``{}``.

    Raises:
        ValueError: not an object, no string name, or arguments that are not an object.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call must be an object with a string `name`")
    args: Any = {}
    for k in args_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        args = json.loads(args)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return PartialToolCall(name=obj["name"], arguments=args, complete=True)


# A complete "name" string at the start of a call object.
_LEADING_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def partial_call_from_json(text: str, args_keys: Sequence[str] = ("arguments", "parameters")
                           ) -> PartialToolCall:
    """A partial call from a prefix of a ``{"name": ..., "arguments": {...}}`` JSON text.

    Raises:
        ValueError: the prefix is malformed or is not an object.
    """
    full = partial_json(text)
    if full is None:
        return PartialToolCall()
    if not isinstance(full, dict):
        raise ValueError("a tool call must be a JSON object")
    m = _LEADING_NAME.match(text)
    if m:  # the usual order, "name" first: no second parse needed
        name = json.loads(m.group(1))
    else:
        done = partial_json(text, complete_strings_only=True) or {}
        name = done.get("name") if isinstance(done, dict) else None
    args = None
    for k in args_keys:
        if k in full:
            args = full[k]
            break
    return PartialToolCall(name=name if isinstance(name, str) and name else None,
                           arguments=args if isinstance(args, dict) else None)


class ToolParser:
    """Base class of the tool-call parsers (vLLM's interface, one instance per request).

    Subclasses implement :meth:`parse`; ``markers`` lists the format's marker strings (a
    marker the tokenizer treats as a special token makes :meth:`adjust_request` keep special
    tokens in the output text, or the marker would never be seen).
    """

    markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any):
        self.model_tokenizer = tokenizer
        # Tool name -> JSON schema of its parameters (for formats whose values are untyped).
        self.tool_schemas: dict[str, dict] = {}
        self._streamer: Optional[ToolCallStreamer] = None
        self._partial_cache: dict[Any, tuple[str, Any]] = {}

    # ---- request-time hooks ---------------------------------------------------------------
    def set_tools(self, tools: Optional[Sequence[Any]]) -> None:
        """Remember the request's tools (``{"type": "function", "function": {...}}`` dicts or
        models) so typed formats can convert argument values."""
        self.tool_schemas = {}
        for t in tools or []:
            t = t.model_dump() if hasattr(t, "model_dump") else t
            fn = t.get("function", t) if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.tool_schemas[fn["name"]] = fn.get("parameters") or {}

    def adjust_request(self, request: Any) -> Any:
        """Adapt the request before generation (keep special tokens when a marker is one)."""
        self.set_tools(getattr(request, "tools", None))
        if self.markers and _special_tokens(self.model_tokenizer).intersection(self.markers):
            request.skip_special_tokens = False
        return request

    def make_tool_call_id(self) -> str:
        return random_tool_call_id()

    def partial(self, key: Any, text: str, parse: Callable[[str], Any]) -> Any:
        """``parse(text)`` for the unfinished part of a streamed output (``key`` names it,
        e.g. its start offset). NOTE: partial JSON parsing is linear in the text, so parsing
        a growing call on every token is quadratic; a text over 1 KiB is parsed again only
        once it grew by 1/32 (its earlier parse, a prefix, is returned meanwhile), which
        bounds the work to O(n log n) at the price of coarser fragments for long arguments."""
        cached = self._partial_cache.get(key)
        if cached is not None and len(text) >= len(cached[0]):
            if len(text) - len(cached[0]) < max(1, (len(text) - 1024) // 32):
                return cached[1]
        res = parse(text)
        self._partial_cache = {key: (text, res)}
        return res

    # ---- parsing ------------------------------------------------------------------------
    def parse(self, text: str, final: bool) -> ToolParse:
        """See the module docstring. Subclasses implement this."""
        raise NotImplementedError

    def safe_parse(self, text: str, final: bool) -> Optional[ToolParse]:
        """``parse`` that never raises: a final parse that fails is all content; a streaming
        parse that fails returns None (nothing new can be said yet)."""
        try:
            res = self.parse(text, final)
        except Exception:
            logger.debug("tool parser %s failed on %r", type(self).__name__, text[-200:],
                         exc_info=True)
            return ToolParse(content=text) if final else None
        if final and (not res.calls
                      or any(not c.complete or c.name is None for c in res.calls)):
            return ToolParse(content=text)  # no (well-formed) call: the output is content
        return res

    def extract_tool_calls(self, model_output: str, request: Any = None
                           ) -> ExtractedToolCallInformation:
        """The calls in a complete output (vLLM's method)."""
        if request is not None:
            self.set_tools(getattr(request, "tools", None))
        res = self.safe_parse(model_output, final=True)
        assert res is not None
        if not res.calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[],
                                                content=model_output)
        calls = [ToolCall(id=self.make_tool_call_id(),
                          function=FunctionCall(name=c.name, arguments=c.final_arguments()))
                 for c in res.calls]
        content = res.content.rstrip()
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls,
                                            content=content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, previous_token_ids: Sequence[int] = (),
                                     current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (),
                                     request: Any = None) -> Optional[dict[str, Any]]:
        """vLLM's streaming method: the delta (``{"content"?, "tool_calls"?}``) for the output
        so far, or None when there is nothing new. Call :meth:`finish_streaming` at the end."""
        if self._streamer is None:
            self._streamer = ToolCallStreamer(self)
        content, calls = self._streamer.update(current_text, final=False)
        return _delta_dict(content, calls)

    def finish_streaming(self, current_text: str) -> Optional[dict[str, Any]]:
        if self._streamer is None:
            self._streamer = ToolCallStreamer(self)
        content, calls = self._streamer.update(current_text, final=True)
        return _delta_dict(content, calls)


def _delta_dict(content: str, calls: list[DeltaToolCall]) -> Optional[dict[str, Any]]:
    d: dict[str, Any] = {}
    if content:
        d["content"] = content
    if calls:
        d["tool_calls"] = [c.to_dict() for c in calls]
    return d or None


def _special_tokens(tokenizer: Any) -> set[str]:
    out = set(getattr(tokenizer, "all_special_tokens", None) or [])
    dec = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in dec.values():
        if getattr(tok, "special", False):
            out.add(str(tok))
    return out


class ToolCallStreamer:
    """Turns the growing output of one choice into content and ``delta.tool_calls`` fragments.

    ``update(text, final)`` takes the whole output so far (``final`` once it is complete) and
    returns what was not sent yet: (content delta, list of DeltaToolCall). Content is held
    back while it may still turn into a call marker, and trailing whitespace until more text
    follows (the final content of an output with calls is right-stripped).

    Args:
        parser: the request's parser.
        max_calls: report at most this many calls (1 for ``parallel_tool_calls=false``).
    """

    def __init__(self, parser: ToolParser, max_calls: Optional[int] = None):
        self.parser = parser
        self.max_calls = max_calls
        self.sent_content = ""
        self.ids: list[str] = []
        self.names: list[str] = []
        self.sent_args: list[str] = []

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        res = self.parser.safe_parse(text, final)
        if final and self.ids and (res is None or len(res.calls) < len(self.ids)):
            # the output ended inside a call already streamed (cut by max_tokens): the final
            # parse refuses it and would send its raw text again as content; keep the streamed view
            res = self.parser.safe_parse(text, False)
        if res is None:
            return "", []
        calls = res.calls if self.max_calls is None else res.calls[: self.max_calls]
        if final:
            content = res.content.rstrip() if res.calls else res.content
        else:
            content = res.content.rstrip()
        content_delta = ""
        if len(content) > len(self.sent_content) and content.startswith(self.sent_content):
            content_delta = content[len(self.sent_content):]
            self.sent_content = content
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # later calls cannot be reported before this one's name
            if i >= len(self.ids):
                self.ids.append(self.parser.make_tool_call_id())
                self.names.append(call.name)
                self.sent_args.append("")
                deltas.append(DeltaToolCall(index=i, id=self.ids[i], type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments="")))
            elif call.name != self.names[i]:
                logger.debug("tool call %d changed name %r -> %r; ignored", i, self.names[i],
                             call.name)
                break
            args = call.stable_arguments()
            sent = self.sent_args[i]
            if len(args) > len(sent) and args.startswith(sent):
                frag = args[len(sent):]
                self.sent_args[i] = args
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=frag)))
            elif not args.startswith(sent):
                logger.debug("tool call %d arguments diverged from what was streamed", i)
            if not call.complete:
                break  # the calls after an unfinished one are not visible yet
        return content_delta, deltas


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------


class ToolParserManager(ClassRegistry, base=ToolParser, kind="tool call parser", type_kind="tool parser"):
    """Name -> ToolParser class (vLLM's ``ToolParserManager``; ``ClassRegistry`` methods)."""

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            KeyError: no such parser (the message lists the registered names).
        """
        return cls.get(name)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import a Python file that registers parsers (``--tool-parser-plugin``).

        Raises:
            ValueError: the file does not exist or fails to import.
        """
        path = os.path.abspath(plugin_path)
        if not os.path.isfile(path):
            raise ValueError(f"--tool-parser-plugin: no such file {plugin_path!r}")
        mod_name = "pagedllm_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--tool-parser-plugin: cannot import {plugin_path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise ValueError(f"--tool-parser-plugin {plugin_path!r} failed to import: "
                             f"{type(e).__name__}: {e}") from e
