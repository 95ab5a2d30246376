"""A new endpoint is one file plus a registration: a test-only ``POST /v1/shout`` (a completion
answered in upper case) built on the serving template (``OpenAIServing.begin_request`` /
``process_prompt`` / ``prepare`` / ``run``) and added with ``register_router``; it streams and
collects through the real engine on a tiny random model, and its errors are the template's."""
from __future__ import annotations

import argparse
import json
from typing import Any, Optional

import pytest
from fastapi import APIRouter, Request
from fastapi.testclient import TestClient

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai import api_server
from pagedllm.entrypoints.openai.api_server import build_app, register_router
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, ResponseBuilder

from arch_cases import make_checkpoint

TINY_KW = dict(dtype="float32", num_threads=1, block_size=4, kv_cache_memory="256KiB", max_num_batched_tokens=64)


class ShoutServing(OpenAIServing):
    """``/v1/shout``: ``{"model", "prompt", "max_tokens", ...}`` (a CompletionRequest) ->
    ``{"id", "model", "text"}`` with the completion in upper case; streamed: ``data: {"text"}``
    events then ``data: [DONE]``."""

    async def create(self, request: CompletionRequest, raw_request: Optional[Request]) -> Any:
        rid, _, model_name = self.begin_request(request, raw_request, "shout")
        p = request.prompt
        prompt = self.process_prompt({"prompt_token_ids": p} if isinstance(p, list) else p)
        req = self.prepare(f"{rid}-0", prompt, request, model=request.model)

        def stream(merged):
            return self.stream_results(
                merged, [req.request_id],
                on_result=lambda i, out: [f"data: {json.dumps({'text': out.outputs[0].text.upper()})}\n\n"],
                on_end=lambda stopping: [], on_error=lambda e: [f"data: {json.dumps({'error': str(e)})}\n\n"],
                done="data: [DONE]\n\n")

        def build(results):
            return {"id": rid, "model": model_name, "text": results[0][-1].outputs[0].text.upper()}

        return await self.run([req], bool(request.stream), ResponseBuilder(stream=stream, build=build), raw_request)


def shout_router(servings: Any, args: Any) -> APIRouter:
    serving = ShoutServing(servings.engine, servings.served)
    router = APIRouter()

    @router.post("/v1/shout")
    async def shout(request: CompletionRequest, raw_request: Request):
        return await serving.create(request, raw_request)

    return router


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_checkpoint("llama", path)
    register_router(shout_router)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, **TINY_KW))
    try:
        with TestClient(build_app(engine, argparse.Namespace(served_model_name=["tiny"]))) as c:
            yield c
    finally:
        api_server._ROUTER_BUILDERS.remove(shout_router)
        engine.shutdown()


def test_registered_endpoint_collects_and_streams(client):
    body = {"model": "tiny", "prompt": [5, 17, 3, 88, 42], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ref = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    r = client.post("/v1/shout", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["model"] == "tiny" and got["id"].startswith("shout-")
    assert got["text"] == ref.upper() and got["text"]
    with client.stream("POST", "/v1/shout", json={**body, "stream": True}) as s:
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["text"] for e in events[:-1]) == ref.upper()


def test_registered_endpoint_errors_are_the_templates(client):
    r = client.post("/v1/shout", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/v1/shout", json={"model": "tiny", "prompt": [1, 2], "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # The built-in routes are still served beside it.
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
