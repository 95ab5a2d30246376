"""Ollama's embedding routes (/api/embed, legacy /api/embeddings) on a tiny pooling checkpoint,
through the official ``ollama`` client: the same vectors as the offline ``LLM.embed``, token
counts, truncation from the end, and the errors of a pooling-only server."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM

ollama = pytest.importorskip("ollama")

KW = dict(dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1, max_model_len=64)


def test_ollama_embed_routes(tiny_llama_causal, smollm2_tokenizer):
    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    texts = ["red apples", "a much longer sentence about green pears and oranges"]
    long_text = " ".join(["pears"] * 100)
    long_ids = smollm2_tokenizer.encode(long_text)
    assert len(long_ids) > 64
    offline = LLM(tiny_llama_causal, runner="pooling", convert="embed", **KW)
    outs = offline.embed(texts + [{"prompt_token_ids": long_ids[:64]}], use_tqdm=False)
    want = [o.outputs.data for o in outs]
    n_tokens = [len(o.prompt_token_ids) for o in outs]
    del offline
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, runner="pooling", convert="embed", **KW))
    args = make_arg_parser().parse_args([tiny_llama_causal, "--served-model-name", "tiny"])
    args.disable_log_requests = True
    app = build_app(engine, args)

    async def main():
        transport = httpx.ASGITransport(app=app)
        client = ollama.AsyncClient(host="http://test", transport=transport, timeout=60)
        r = await client.embed(model="tiny:latest", input=texts)
        assert len(r.embeddings) == 2 and r.prompt_eval_count == sum(n_tokens[:2])
        for got, w in zip(r.embeddings, want):
            torch.testing.assert_close(torch.tensor(got), w, rtol=0, atol=1e-6)
            assert abs(float(torch.tensor(got).norm()) - 1) < 1e-5
        r = await client.embed(model="tiny", input=texts[0])
        torch.testing.assert_close(torch.tensor(r.embeddings[0]), want[0], rtol=0, atol=1e-6)
        # truncate (default): the end is cut to fit the context
        r = await client.embed(model="tiny", input=long_text)
        assert r.prompt_eval_count == 64
        torch.testing.assert_close(torch.tensor(r.embeddings[0]), want[2], rtol=0, atol=1e-6)
        with pytest.raises(ollama.ResponseError) as e:
            await client.embed(model="tiny", input=long_text, truncate=False)
        assert e.value.status_code == 400 and "maximum model length" in e.value.error
        # legacy /api/embeddings: one vector, not normalised (as Ollama), same direction
        legacy = (await client.embeddings(model="tiny", prompt=texts[1])).embedding
        v = torch.tensor(legacy)
        assert abs(float(v.norm()) - 1) > 1e-3
        torch.testing.assert_close(v / v.norm(), want[1], rtol=0, atol=1e-5)
        # a pooling server does not generate; the capabilities say so
        with pytest.raises(ollama.ResponseError) as e:
            await client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 400 and "does not support generate" in e.value.error
        assert (await client.show("tiny")).capabilities == ["embedding"]
        with pytest.raises(ollama.ResponseError) as e:
            await client.embed(model="other", input="x")
        assert e.value.status_code == 404
        with pytest.raises(ollama.ResponseError) as e:
            await client.embed(model="tiny", input=[])
        assert e.value.status_code == 400 and "empty" in e.value.error

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
