"""Default fixtures of the in-process server tests in this folder: ``engine``, a ``FakeAsyncLLM``
(max_model_len 256), and ``client``, a ``TestClient`` on ``build_app`` with ``pagedllm serve``'s
default flags. A module that needs another engine or flags defines its own (it overrides these)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def engine():
    from fake_engine import FakeAsyncLLM

    return FakeAsyncLLM(max_model_len=256)


@pytest.fixture(scope="module")
def client(engine):
    from api_helpers import make_args
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app

    with TestClient(build_app(engine, make_args())) as c:
        yield c
