"""Tool-call parsers (``--tool-call-parser NAME``), vLLM's names and registry.

=================  ==============================================================
name               model families
=================  ==============================================================
hermes             Hermes 2 Pro / Hermes 3, Qwen 2.5 / Qwen 3 / QwQ, SmolLM3,
                   SmolLM2 with ``chat_templates/tool_chat_template_smollm2_hermes.jinja``
llama3_json        Llama 3.1 / 3.2 / 3.3 (JSON tool calling); alias llama4_json
mistral            Mistral 7B v0.3, Mixtral 8x22B, Mistral-Nemo, Mistral-Small/Large
pythonic           Llama 3.2 / Llama 4 pythonic templates, ToolACE; alias llama4_pythonic
qwen3_coder        Qwen3-Coder, Qwen3-Next / Qwen3.5 XML format; alias qwen3_xml
deepseek_v3        DeepSeek-V3 / R1-0528; alias deepseek_v31 (V3.1 format)
=================  ==============================================================
"""
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (  # noqa: F401
    PartialToolCall, ToolCallStreamer, ToolParse, ToolParser, ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers import (  # noqa: F401  (registers the parsers)
    deepseekv3_tool_parser, hermes_tool_parser, llama_tool_parser, mistral_tool_parser,
    pythonic_tool_parser, qwen3coder_tool_parser)

__all__ = ["PartialToolCall", "ToolCallStreamer", "ToolParse", "ToolParser",
           "ToolParserManager"]
