"""Reasoning parsers (``--reasoning-parser NAME``): split ``reasoning`` from ``content``.

============  ================================================================
name          model families
============  ================================================================
deepseek_r1   DeepSeek-R1 (+ distills), DeepSeek-V3.1 thinking, Qwen3-*-Thinking-2507
qwen3         Qwen3 hybrid models (``enable_thinking`` on/off), QwQ
think         generic explicit ``<think>`` block (alias ``basic``): SmolLM3, Phi-4-reasoning, ...
============  ================================================================
"""
from pagedllm.reasoning.abs_reasoning_parsers import (ReasoningParser,  # noqa: F401
                                                      ReasoningParserManager, ReasoningStreamer)
from pagedllm.reasoning import (basic_parsers, deepseek_r1_reasoning_parser,  # noqa: F401
                                qwen3_reasoning_parser)

__all__ = ["ReasoningParser", "ReasoningParserManager", "ReasoningStreamer"]
