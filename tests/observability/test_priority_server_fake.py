"""The ``priority`` field of /v1/chat/completions and /v1/completions against a first-come-first-
served engine (the stand-in engine with the real input processor): 0 is accepted, a nonzero value
or a non-integer is a 400 naming ``priority``."""
from __future__ import annotations

import os
import sys

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints"))
from fake_engine import FakeAsyncLLM  # noqa: E402
from api_helpers import make_args  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CMPL = {"prompt": "hi", "max_tokens": 3}


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(FakeAsyncLLM(max_model_len=256), make_args())) as c:
        yield c


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT), ("/v1/completions", CMPL)])
def test_priority_field(client, route, body):
    assert client.post(route, json={**body, "priority": 0}).status_code == 200
    r = client.post(route, json={**body, "priority": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    r = client.post(route, json={**body, "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
