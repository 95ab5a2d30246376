"""The server's LoRA plumbing without a model: ``--lora-modules`` parsing, the runtime-update
routes present only behind the flag or vLLM's environment variable, and start-up errors."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
from fake_engine import FakeAsyncLLM  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app, run_server  # noqa: E402
from pagedllm.entrypoints.openai.cli_args import LoRAModulePath, make_arg_parser, parse_lora_module  # noqa: E402


def test_parse_lora_module_forms():
    assert parse_lora_module("sql=/ad/sql") == LoRAModulePath("sql", "/ad/sql")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    for bad in ("sql", "=/p", "x=", '{"name": "x"}', "{oops"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def _routes(args, monkeypatch, env=None):
    for v in ("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(v, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    engine = FakeAsyncLLM(enable_lora=True)
    app = build_app(engine, args)
    # (FastAPI >= 0.165 keeps an included router as one entry of app.routes: read the schema.)
    return set(app.openapi()["paths"]), app


@pytest.mark.parametrize("flag,env,present", [
    (False, None, False),
    (True, None, True),
    (False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, True),
    (False, {"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, True),
    (False, {"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}, False),
])
def test_runtime_routes_only_when_allowed(monkeypatch, flag, env, present):
    args = make_arg_parser().parse_args(["--enable-lora"] + (["--allow-runtime-lora-updating"] if flag else []))
    routes, app = _routes(args, monkeypatch, env)
    assert ("/v1/load_lora_adapter" in routes) is present
    assert ("/v1/unload_lora_adapter" in routes) is present
    assert app.state.loras is not None


def test_no_registry_without_enable_lora(monkeypatch):
    engine = FakeAsyncLLM()
    app = build_app(engine, make_arg_parser().parse_args([]))
    assert app.state.loras is None


def test_start_up_errors_before_the_model_loads(tmp_path, capsys):
    parser = make_arg_parser()
    assert run_server(parser.parse_args(["--lora-modules", f"a={tmp_path}"])) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert run_server(parser.parse_args(["--enable-lora", "--lora-modules", f"a={tmp_path / 'nope'}"])) == 2
    err = capsys.readouterr().err
    assert "LoRA adapter 'a'" in err and "No adapter found" in err
