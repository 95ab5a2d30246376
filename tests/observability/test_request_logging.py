"""Request / output logging flags (vLLM >= 0.10.2): nothing is logged by default,
--enable-log-requests logs each request, --enable-log-outputs (with it) each finished choice,
--max-log-len clips, and --disable-log-requests is a deprecated no-op with a warning."""
from __future__ import annotations

import logging
import os
import sys

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints"))
from fake_engine import FakeAsyncLLM  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.cli_args import make_arg_parser, normalize_args  # noqa: E402

LOGGER = "pagedllm.entrypoints.openai"


def _run(flags: list[str], caplog, stream: bool = False):
    args = normalize_args(make_arg_parser().parse_args(flags))
    args.api_key = None
    with caplog.at_level(logging.INFO):
        with TestClient(build_app(FakeAsyncLLM(max_model_len=256), args)) as client:
            caplog.clear()
            r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 5, "n": 2,
                                                     "stream": stream})
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name.startswith(LOGGER)]
    return r, [x for x in lines if x.startswith(("Received request", "Generated response"))]


def test_off_by_default(caplog):
    _, lines = _run([], caplog)
    assert lines == []


def test_enable_log_requests_and_outputs(caplog):
    r, lines = _run(["--enable-log-requests"], caplog)
    assert len(lines) == 1 and lines[0].startswith("Received request cmpl-")
    assert "'Hello there'" in lines[0] and "prompt_token_ids: [" in lines[0]
    r, lines = _run(["--enable-log-requests", "--enable-log-outputs"], caplog)
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    outs = [x for x in lines if x.startswith("Generated response")]
    assert len(outs) == 2  # one per choice
    for i, text in enumerate(texts):
        (line,) = [x for x in outs if f"(choice {i})" in x]
        assert f"output: {text!r}" in line and "finish_reason: length" in line


def test_streamed_outputs_are_logged_whole(caplog):
    r, lines = _run(["--enable-log-requests", "--enable-log-outputs"], caplog, stream=True)
    import json
    texts = {0: "", 1: ""}
    for block in r.text.split("\n\n"):
        if block.startswith("data: {"):
            for c in json.loads(block[6:])["choices"]:
                texts[c["index"]] += c["text"]
    outs = [x for x in lines if x.startswith("Generated response")]
    assert len(outs) == 2 and all(texts.values())
    for i, text in texts.items():
        assert any(f"(choice {i}): output: {text!r}" in x for x in outs), (text, outs)


def test_max_log_len_clips(caplog):
    _, lines = _run(["--enable-log-requests", "--max-log-len", "3"], caplog)
    assert "prompt: 'Hel'," in lines[0]


def test_outputs_alone_and_deprecated_flag_warn(caplog):
    with caplog.at_level(logging.WARNING):
        normalize_args(make_arg_parser().parse_args(["--disable-log-requests"]))
        normalize_args(make_arg_parser().parse_args(["--enable-log-outputs"]))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("--disable-log-requests is deprecated and has no effect" in m for m in msgs)
    assert any("--enable-log-outputs has no effect without --enable-log-requests" in m for m in msgs)
    _, lines = _run(["--disable-log-requests"], caplog)
    assert lines == []
    _, lines = _run(["--enable-log-outputs"], caplog)
    assert lines == []
