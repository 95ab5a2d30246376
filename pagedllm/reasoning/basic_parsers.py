"""The generic ``<think>`` parser (``think``): reasoning only in an explicit
``<think>`` ... ``</think>`` block at the start of the output; any other output is content.
Serves models that write the opening tag themselves (Qwen3 hybrid, QwQ, Phi-4-reasoning,
SmolLM3, Magistral-style ``<think>`` outputs, ...)."""
from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module(["think", "basic"])
class ThinkReasoningParser(ReasoningParser):
    start_optional = False
