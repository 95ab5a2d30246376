"""HTTP pooling endpoints on tiny checkpoints: openai client, /rerank, /score, /classify, errors."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from server_helpers import run_in_process

KW = dict(dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1, max_model_len=64)


def _app(engine):
    from fastapi import FastAPI

    from pagedllm.entrypoints.openai.errors import install_exception_handlers
    from pagedllm.entrypoints.openai.serving_pooling import build_pooling_router

    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(build_pooling_router(engine, ["tiny"]))
    return app


def _serve(engine, body):
    return run_in_process(lambda: _app(engine), body, engine.shutdown)


def _err(r, status=400, contains=""):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["code"] == status and contains in e["message"], e
    return e


def test_embeddings_openai_client_and_errors(tiny_llama_causal):
    import openai

    from pagedllm import LLM
    texts = ["red apples", "a much longer sentence about green pears and oranges"]
    offline = LLM(tiny_llama_causal, runner="pooling", convert="embed", **KW)
    want = [o.outputs.data for o in offline.embed(texts, use_tqdm=False)]
    want_ids = [o.prompt_token_ids for o in offline.embed(texts, use_tqdm=False)]
    del offline
    # dimensions needs a Matryoshka model (vLLM): declared here through --hf-overrides
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, runner="pooling", convert="embed",
                                                  hf_overrides={"is_matryoshka": True}, **KW))

    async def body(client):
        oc = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=client)
        r = await oc.embeddings.create(model="tiny", input=texts, encoding_format="float")
        assert [d.index for d in r.data] == [0, 1] and r.model == "tiny"
        for d, w in zip(r.data, want):
            torch.testing.assert_close(torch.tensor(d.embedding), w, rtol=0, atol=1e-6)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in want_ids)
        r = await oc.embeddings.create(model="tiny", input=texts)  # client asks base64, decodes itself
        for d, w in zip(r.data, want):
            torch.testing.assert_close(torch.tensor(d.embedding), w, rtol=0, atol=1e-6)
        r = await oc.embeddings.create(model="tiny", input=texts[0], encoding_format="base64", dimensions=8)
        v = np.frombuffer(base64.b64decode(r.data[0].embedding), dtype="<f4")
        assert v.shape == (8,) and abs(float(np.linalg.norm(v)) - 1) < 1e-5
        # token ids in, used exactly as given
        r = await oc.embeddings.create(model="tiny", input=[want_ids[1]], encoding_format="float")
        torch.testing.assert_close(torch.tensor(r.data[0].embedding), want[1], rtol=0, atol=1e-6)
        # errors
        _err(await client.post("/v1/embeddings", json={"input": []}), 400, "empty")
        _err(await client.post("/v1/embeddings", json={"input": list(range(1, 70))}), 400, "maximum model length")
        _err(await client.post("/v1/embeddings", json={"input": "x", "dimensions": 10_000}), 400, "dimensions")
        _err(await client.post("/v1/embeddings", json={"input": "x", "model": "nope"}), 404)
        _err(await client.post("/classify", json={"input": "x"}), 400, "classification")
        with pytest.raises(openai.BadRequestError):
            await oc.embeddings.create(model="tiny", input=[])
        # /pooling: raw (unnormalized) vectors as nested lists
        r = await client.post("/pooling", json={"input": texts[:1]})
        d = r.json()["data"][0]
        assert d["object"] == "pooling" and len(d["data"]) == 64
        # /rerank on an embed model: cosine similarity, sorted, top_n, return_documents
        docs = ["green pears", "red apples", "blue sky", "red apples!"]
        r = (await client.post("/rerank", json={"query": "red apples", "documents": docs, "top_n": 2})).json()
        res = r["results"]
        assert [x["index"] for x in res] == [1, 3] and res[0]["document"] == {"text": "red apples"}
        assert res[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5) and res[1]["relevance_score"] < 1
        r = (await client.post("/v1/score", json={"text_1": "red apples", "text_2": docs})).json()
        scores = [x["score"] for x in r["data"]]
        r2 = (await client.post("/v2/rerank", json={"query": "red apples", "documents": docs,
                                                    "return_documents": False})).json()
        assert [x["index"] for x in r2["results"]] == sorted(range(4), key=lambda i: -scores[i])
        assert all("document" not in x for x in r2["results"])
        return True

    assert _serve(engine, body)


def test_classify_score_rerank_cross_encoder(tiny_qwen2_cls1, tiny_llama_cls3, smollm2_tokenizer):
    import transformers
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_qwen2_cls1).eval()
    q = "what is a cat?"
    docs = ["a small furry animal", "a programming language", "the capital of France", "a big dog"]
    with torch.no_grad():
        ref = [float(torch.sigmoid(hf(**smollm2_tokenizer(q, d, return_tensors="pt")).logits[0, 0])) for d in docs]
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_qwen2_cls1, runner="pooling", **KW))

    async def body(client):
        r = (await client.post("/score", json={"text_1": q, "text_2": docs})).json()
        assert [x["object"] for x in r["data"]] == ["score"] * 4
        assert [x["score"] for x in r["data"]] == pytest.approx(ref, abs=1e-5)
        r = (await client.post("/v1/score", json={"queries": [q] * 4, "documents": docs})).json()
        assert [x["score"] for x in r["data"]] == pytest.approx(ref, abs=1e-5)
        r = (await client.post("/v1/rerank", json={"model": "tiny", "query": q, "top_n": 3,
                                                   "documents": [{"text": d} for d in docs]})).json()
        order = sorted(range(4), key=lambda i: -ref[i])[:3]
        assert [x["index"] for x in r["results"]] == order
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([ref[i] for i in order], abs=1e-5)
        assert r["results"][0]["document"]["text"] == docs[order[0]]
        _err(await client.post("/rerank", json={"query": q, "documents": []}), 400, "documents")
        _err(await client.post("/score", json={"text_1": [q, q], "text_2": docs}), 400, "text_1")
        _err(await client.post("/v1/embeddings", json={"input": "x"}), 400, "embeddings")
        return True

    assert _serve(engine, body)

    hf3 = transformers.AutoModelForSequenceClassification.from_pretrained(tiny_llama_cls3).eval()
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_cls3, runner="pooling", **KW))

    async def body3(client):
        r = (await client.post("/classify", json={"input": docs[:2]})).json()
        for t, d in zip(docs[:2], r["data"]):
            with torch.no_grad():
                p = hf3(**smollm2_tokenizer(t, return_tensors="pt")).logits[0].softmax(-1)
            assert d["num_classes"] == 3 and d["probs"] == pytest.approx(p.tolist(), abs=1e-5)
            assert d["label"] == hf3.config.id2label[int(p.argmax())]
        _err(await client.post("/score", json={"text_1": "a", "text_2": "b"}), 400, "num_labels=3")
        return True

    assert _serve(engine, body3)


def test_generation_model_rejected(tiny_llama_causal):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, **KW))

    async def body(client):
        for path, payload in (("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                              ("/classify", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                              ("/rerank", {"query": "a", "documents": ["b"]})):
            e = _err(await client.post(path, json=payload), 400, "generation model")
            assert "--runner pooling" in e["message"]
        with pytest.raises(ValueError, match="not a pooling model"):
            await engine.encode("hi", None, "x1")
        return True

    assert _serve(engine, body)


def test_pooling_goes_the_one_input_path_and_is_counted(tiny_llama_causal):
    """AsyncLLM (an EngineClient) takes the EngineCoreRequest its input processor builds, as the
    server does; the result equals LLM.embed's, and each pooling request is a finished request in
    the engine's metrics (its prompt tokens, e2e latency) like a generation request, leaving no
    per-request state behind (its output came through the OutputProcessor)."""
    from pagedllm import LLM
    from pagedllm.engine.protocol import missing_members
    from pagedllm.inputs import TokensPrompt
    from pagedllm.pooling_params import PoolingParams

    ids = [5, 17, 42, 7, 99]
    want = LLM(tiny_llama_causal, runner="pooling", convert="embed", **KW).embed(
        [TokensPrompt(prompt_token_ids=ids), "red apples"], use_tqdm=False)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, runner="pooling", convert="embed",
                                                  **KW))
    assert missing_members(engine) == []
    records = []

    class Recorder:
        def record(self, scheduler_stats, iteration_stats):
            records.append(iteration_stats)

    engine.stat_loggers.append(Recorder())

    async def run():
        req = engine.input_processor.process_inputs("e1", TokensPrompt(prompt_token_ids=ids), PoolingParams(),
                                                    task="embed")
        assert req.pooling_params is not None and req.sampling_params is None and req.prompt_token_ids == ids
        a = await engine.encode(req, None, "e1")
        b = await engine.encode("red apples", None, "e2", task="embed")
        with pytest.raises(ValueError, match="does not match"):
            await engine.encode(req, None, "other-id")
        return a, b

    try:
        a, b = asyncio.run(run())
        counts = engine.engine.get_request_state_counts()
    finally:
        engine.shutdown()
    for got, ref in zip((a, b), want):
        assert got.prompt_token_ids == ref.prompt_token_ids
        torch.testing.assert_close(got.outputs.data, ref.outputs.data, rtol=1e-5, atol=1e-6)
    finished = [f for it in records for f in it.finished_requests]
    assert sorted(f.num_prompt_tokens for f in finished) == sorted([len(ids), len(b.prompt_token_ids)])
    assert all(f.finish_reason == "stop" and f.num_generation_tokens == 0 for f in finished)
    assert sum(it.num_prompt_tokens for it in records) == len(ids) + len(b.prompt_token_ids)
    assert counts["output_processor.request_states"] == 0 and counts["engine.req_stats"] == 0


def test_embeddings_of_chat_messages(tiny_llama_causal, smollm2_tokenizer):
    """vLLM's chat embedding request: ``messages`` rendered with the chat template (no generation
    prompt, no special tokens added) embed as the rendered text's ids do; input and messages
    together, or neither, are a 400 naming the field."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, runner="pooling", convert="embed", **KW))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "red apples"}]
    text = smollm2_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]

    async def body(client):
        r = await client.post("/v1/embeddings", json={"model": "tiny", "messages": msgs})
        assert r.status_code == 200, r.text
        by_ids = await client.post("/v1/embeddings", json={"model": "tiny", "input": [ids]})
        assert by_ids.status_code == 200, (by_ids.text, ids)
        assert r.json()["data"][0]["embedding"] == by_ids.json()["data"][0]["embedding"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        gen = await client.post("/v1/embeddings", json={"model": "tiny", "messages": msgs,
                                                        "add_generation_prompt": True})
        assert gen.json()["usage"]["prompt_tokens"] > len(ids)
        pooled = await client.post("/pooling", json={"model": "tiny", "messages": msgs, "task": "embed"})
        assert pooled.json()["data"][0]["data"] == r.json()["data"][0]["embedding"]
        _err(await client.post("/v1/embeddings", json={"model": "tiny"}), 400, "input: Field required")
        _err(await client.post("/v1/embeddings", json={"model": "tiny", "input": "x", "messages": msgs}), 400,
             "not both")
        _err(await client.post("/v1/embeddings", json={"model": "tiny", "messages": []}), 400, "messages")

    _serve(engine, body)


def test_an_empty_input_fails_the_whole_request_first(tiny_llama_causal):
    """["ok", "", "fine"]: a 400 naming input[1] before any input runs (no request counted as
    run or aborted); a lone "" names input."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, runner="pooling", convert="embed", **KW))
    seen = []
    real = engine.encode

    async def spy(prompt, *a, **kw):
        seen.append(prompt)
        return await real(prompt, *a, **kw)

    engine.encode = spy

    async def body(client):
        e = _err(await client.post("/v1/embeddings", json={"model": "tiny", "input": ["ok", "", "fine"]}), 400,
                 "input[1]: The prompt cannot be empty")
        assert e["param"] == "input" and seen == []
        e = _err(await client.post("/v1/embeddings", json={"model": "tiny", "input": ""}), 400, "input: The prompt")
        assert e["param"] == "input" and seen == []
        e = _err(await client.post("/classify", json={"model": "tiny", "input": [[5, 6], []]}), 400, "input[1]")
        assert seen == []
        assert (await client.post("/v1/embeddings", json={"model": "tiny", "input": ["ok", "fine"]})).status_code == 200
        assert seen == ["ok", "fine"]

    _serve(engine, body)
