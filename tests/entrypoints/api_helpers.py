"""Shared pieces of the in-process server tests (fake / scripted engines): server flags, SSE
parsing, the OpenAI error-shape check and the tool-calling chat template. Import from here,
not from another test module (``sys.path`` holds this folder: see the importers)."""
from __future__ import annotations

import argparse
import json
import os

from pagedllm.entrypoints.openai.cli_args import make_arg_parser

MODEL = "SmolLM2-135M-Instruct"
#: SmolLM2's chat template with Hermes-style tool calls (the tool-calling tests' template).
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "entrypoints", "openai",
                        "chat_templates", "tool_chat_template_smollm2_hermes.jinja")
#: A scripted answer with text and two Hermes tool calls (get_weather, get_time).
TWO_CALLS = ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
             "{\"city\": \"Paris\", \"unit\": \"C\"}}\n</tool_call>\n<tool_call>\n"
             "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>")


def make_args(**kw) -> argparse.Namespace:
    """``pagedllm serve``'s defaults (no API key, request logging off) with ``kw`` set."""
    args = make_arg_parser().parse_args([])
    args.api_key = None
    args.disable_log_requests = True
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def sse_events(text: str) -> list:
    """The JSON events of an OpenAI SSE body, checking it ends with exactly one ``[DONE]``."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return events[:-1]


def assert_error(r, status: int, param=None):
    """Check ``r`` is an OpenAI error body with ``status`` (and ``param``); returns the error."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def has_structured_outputs() -> bool:
    """Whether this build has structured outputs (``StructuredOutputsParams``)."""
    import pagedllm.sampling_params as spm
    return hasattr(spm, "StructuredOutputsParams")
