"""``qwen3``: Qwen3 hybrid-thinking models (Qwen3-0.6B ... 235B-A22B, QwQ-style outputs).

The model writes ``<think>`` ... ``</think>`` itself; with ``chat_template_kwargs:
{"enable_thinking": false}`` the template closes an empty block in the prompt and the output
is all content. An output that does not start with ``<think>`` has no reasoning.
"""
from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    start_optional = False
