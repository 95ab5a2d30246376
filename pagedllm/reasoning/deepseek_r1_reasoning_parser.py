"""``deepseek_r1``: DeepSeek-R1 and its distills (and Qwen3 *Thinking-2507* models).

Their chat templates open ``<think>`` in the prompt, so the output starts inside the
reasoning: everything up to ``</think>`` is reasoning (a leading ``<think>`` is dropped), and an
output that never closes the block (a stream that ended inside the reasoning) is all
reasoning.
"""
from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    start_optional = True
