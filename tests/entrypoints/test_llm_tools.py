"""Offline ``LLM.chat(tools=...)`` on the real SmolLM2 with the shipped hermes template, and a
tool parser applied to its output."""
from __future__ import annotations

import os

import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

pytestmark = pytest.mark.slow

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "entrypoints", "openai",
                        "chat_templates", "tool_chat_template_smollm2_hermes.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_llm_chat_with_tools(smollm2_llm):
    template = open(TEMPLATE).read()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    sp = SamplingParams(temperature=0, max_tokens=24)
    (out,) = smollm2_llm.chat(msgs, sp, use_tqdm=False, chat_template=template, tools=[WEATHER])
    assert '"name": "get_weather"' in out.prompt and "<tools>" in out.prompt
    assert "<tool_response>\n18 C\n</tool_response>" in out.prompt
    text = out.outputs[0].text
    info = ToolParserManager.get_tool_parser("hermes")(smollm2_llm.get_tokenizer()) \
        .extract_tool_calls(text)
    assert info.content == text and not info.tools_called  # SmolLM2 answers in text here
    (plain,) = smollm2_llm.chat(msgs[:1], sp, use_tqdm=False, chat_template=template)
    assert "<tools>" not in plain.prompt
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        smollm2_llm.chat(msgs[:1], sp, use_tqdm=False, chat_template=template, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}])
