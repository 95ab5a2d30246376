"""One choice's output split into reasoning, content and tool calls, whole or streamed.

The reasoning parser (``--reasoning-parser``) runs first; the tool parser (``--tool-call-parser``
for ``tool_choice: "auto"``, or the forced-choice parser) then reads only the content, so
reasoning text never reaches tool-call parsing. Used by Chat Completions, Responses and
Messages alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall
from pagedllm.entrypoints.openai.tool_calling import ToolChoice
from pagedllm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced_tool_parser import (NamedToolParser,
                                                                        RequiredToolParser)
from pagedllm.reasoning import ReasoningParser, ReasoningStreamer


@dataclass
class ParsedOutput:
    """A complete output: ``reasoning`` (None without), ``content`` (None when the output is
    only calls) and ``tool_calls``."""

    reasoning: Optional[str] = None
    content: Optional[str] = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class OutputDelta:
    """What one streamed step adds (empty strings / list when nothing)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    """Parses one choice. Make one per choice (the streaming state is per output).

    Args:
        reasoning_parser: a ReasoningParser instance, or None.
        tool_parser: a ToolParser instance (already given the request's tools), or None.
        max_calls: at most this many calls (1 for ``parallel_tool_calls=false``), or None.
        include_reasoning: report the reasoning (False drops it; it is still kept out of the
            content).
        named: the output is a named-function call (its finish_reason stays "stop").
    """

    def __init__(self, reasoning_parser: Optional[ReasoningParser] = None,
                 tool_parser: Optional[ToolParser] = None, max_calls: Optional[int] = None,
                 include_reasoning: bool = True, named: bool = False):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.max_calls = max_calls
        self.include_reasoning = include_reasoning
        self.named = named
        self.text = ""
        self._reasoning = ReasoningStreamer(reasoning_parser) if reasoning_parser else None
        self._tools = ToolCallStreamer(tool_parser, max_calls) if tool_parser else None
        self._final_calls = False

    @classmethod
    def for_request(cls, tokenizer: Any, choice: ToolChoice, tools: list[dict[str, Any]],
                    auto_parser_cls: Optional[type], reasoning_parser_cls: Optional[type],
                    parallel_tool_calls: bool = True, include_reasoning: bool = True,
                    request: Any = None) -> "OutputParser":
        """The parser for one choice of a request with the resolved tool ``choice``."""
        tool_parser: Optional[ToolParser] = None
        if choice.mode == "named":
            tool_parser = NamedToolParser(tokenizer, choice.name or "")
        elif choice.mode == "required":
            tool_parser = RequiredToolParser(tokenizer)
        elif choice.mode == "auto" and auto_parser_cls is not None:
            tool_parser = auto_parser_cls(tokenizer)
        if tool_parser is not None:
            tool_parser.set_tools(tools)
        reasoning = reasoning_parser_cls(tokenizer) if reasoning_parser_cls else None
        return cls(reasoning, tool_parser, None if parallel_tool_calls else 1,
                   include_reasoning, named=choice.mode == "named")

    @property
    def active(self) -> bool:
        """Whether this parser changes anything (else the raw text is the content)."""
        return self.reasoning_parser is not None or self.tool_parser is not None

    @property
    def tools_called(self) -> bool:
        return self._final_calls or (self._tools is not None and self._tools.tools_called)

    def finish_reason(self, engine_reason: Optional[str]) -> str:
        """OpenAI's finish_reason: "tool_calls" when calls were made (not for a named
        function, as OpenAI and vLLM), else the engine's."""
        if self.tools_called and not self.named and engine_reason in (None, "stop"):
            return "tool_calls"
        return engine_reason or "stop"

    # ---- whole output ------------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            try:
                reasoning, content = self.reasoning_parser.parse(text, final=True)
            except Exception:
                reasoning, content = None, text
        out = ParsedOutput(reasoning=reasoning if self.include_reasoning else None,
                           content=content)
        if self.tool_parser is not None:
            info = self.tool_parser.extract_tool_calls(content or "")
            if info.tools_called:
                calls = info.tool_calls
                out.tool_calls = calls if self.max_calls is None else calls[: self.max_calls]
                out.content = info.content
                self._final_calls = True
        return out

    # ---- streaming ---------------------------------------------------------------------
    def feed_output(self, output: Any) -> OutputDelta:
        """The delta for one engine output step (a ``CompletionOutput`` delta: its ``text``,
        final when it has a ``finish_reason``); the plain text when the parser is not active."""
        if not self.active:
            return OutputDelta(content=output.text)
        return self.feed(output.text, output.finish_reason is not None)

    def feed(self, delta_text: str, final: bool = False) -> OutputDelta:
        """The delta for ``delta_text`` (the output's next piece); ``final`` on the last one
        flushes everything that was held back."""
        self.text += delta_text
        d = OutputDelta()
        if self._reasoning is not None:
            d.reasoning, d.content = self._reasoning.update(self.text, final)
            content_so_far = self._reasoning.content
            if not self.include_reasoning:
                d.reasoning = ""
        else:
            d.content, content_so_far = delta_text, self.text
        if self._tools is not None:
            d.content, d.tool_calls = self._tools.update(content_so_far, final)
        return d
