"""vLLM's pooling activation semantics end to end on tiny checkpoints, offline and served:
``use_activation`` switches the embed normalisation and the classifier softmax/sigmoid for
every task (embed, token_embed, classify, score, token_classify), per request and in the
pooler config; ``normalize`` / ``softmax`` / ``activation`` are deprecated aliases. References
are transformers' own forward passes on the same checkpoints."""
from __future__ import annotations

import base64
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolerConfig, PoolingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from server_helpers import run_in_process

KW = dict(dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1, max_model_len=64)
TEXTS = ["red apples", "a much longer sentence about green pears and oranges"]


@pytest.fixture(scope="module")
def hf_causal(tiny_llama_causal):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_causal, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_cls3(tiny_llama_cls3):
    import transformers
    return transformers.AutoModelForSequenceClassification.from_pretrained(tiny_llama_cls3,
                                                                           dtype=torch.float32).eval()


def _hidden(hf, ids):
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].float()


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_offline_embed_tasks(tiny_llama_causal, hf_causal):
    raw_llm = LLM(tiny_llama_causal, runner="pooling", convert="embed",
                  pooler_config=PoolerConfig(pooling_type="LAST", use_activation=False), **KW)
    outs = raw_llm.embed(TEXTS, use_tqdm=False)
    for o in outs:
        h = _hidden(hf_causal, o.prompt_token_ids)
        _close(o.outputs.data, h[-1])                     # the raw last hidden state ...
        assert abs(float(o.outputs.data.norm()) - 1.0) > 0.1  # ... not L2-normalised
    on = raw_llm.embed(TEXTS, PoolingParams(use_activation=True), use_tqdm=False)
    for o, r in zip(on, outs):
        _close(o.outputs.data, F.normalize(r.outputs.data, dim=-1))
    tok = raw_llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for o in tok:
        _close(o.outputs.data, _hidden(hf_causal, o.prompt_token_ids))  # every token, raw
    tok_on = raw_llm.encode(TEXTS[1], PoolingParams(use_activation=True), pooling_task="token_embed",
                            use_tqdm=False)[0]
    _close(tok_on.outputs.data, F.normalize(_hidden(hf_causal, tok_on.prompt_token_ids), dim=-1))
    del raw_llm
    dflt = LLM(tiny_llama_causal, runner="pooling", convert="embed", **KW)
    for o, r in zip(dflt.embed(TEXTS, use_tqdm=False), outs):
        _close(o.outputs.data, F.normalize(r.outputs.data, dim=-1))
        assert float(o.outputs.data.norm()) == pytest.approx(1.0, abs=1e-5)
    for o in dflt.embed(TEXTS, PoolingParams(use_activation=False), use_tqdm=False):
        _close(o.outputs.data, _hidden(hf_causal, o.prompt_token_ids)[-1])
    with pytest.raises(ValueError, match="does not support matryoshka"):
        dflt.embed(TEXTS[0], PoolingParams(dimensions=8))


def test_offline_classify_tasks(tiny_llama_cls3, hf_cls3, smollm2_tokenizer):
    llm = LLM(tiny_llama_cls3, runner="pooling", pooler_config={"use_activation": False}, **KW)
    w = hf_cls3.score.weight.float()
    for o in llm.classify(TEXTS, use_tqdm=False):
        with torch.no_grad():
            logits = hf_cls3(torch.tensor([o.prompt_token_ids])).logits[0]
        _close(o.outputs.data, logits)                     # raw logits
    per_tok = llm.encode(TEXTS, PoolingParams(use_activation=True), pooling_task="token_classify",
                         use_tqdm=False)
    for o in per_tok:
        with torch.no_grad():
            logits = hf_cls3.model(torch.tensor([o.prompt_token_ids])).last_hidden_state[0] @ w.T
        assert o.outputs.data.shape == (len(o.prompt_token_ids), 3)
        _close(o.outputs.data, logits.softmax(-1))
    del llm
    dflt = LLM(tiny_llama_cls3, runner="pooling", **KW)
    probs = dflt.classify(TEXTS, use_tqdm=False)
    for o in probs:
        with torch.no_grad():
            _close(o.outputs.data, hf_cls3(torch.tensor([o.prompt_token_ids])).logits[0].softmax(-1))
    raw = dflt.classify(TEXTS, PoolingParams(softmax=False), use_tqdm=False)  # deprecated alias
    for o in raw:
        with torch.no_grad():
            _close(o.outputs.data, hf_cls3(torch.tensor([o.prompt_token_ids])).logits[0])


def test_prompt_types(tiny_llama_causal, tiny_qwen2_cls1, smollm2_tokenizer):
    from pagedllm import TextPrompt as TP0, TokensPrompt as TK0
    from pagedllm.inputs import PromptType, TextPrompt, TokensPrompt

    assert (TP0, TK0) == (TextPrompt, TokensPrompt) and PromptType is not None
    ids = smollm2_tokenizer.encode(TEXTS[1])
    emb = LLM(tiny_llama_causal, runner="pooling", convert="embed", **KW)
    a = emb.embed([TextPrompt(prompt=TEXTS[1]), TokensPrompt(prompt_token_ids=ids), TEXTS[1]], use_tqdm=False)
    assert [o.prompt_token_ids for o in a] == [ids] * 3
    torch.testing.assert_close(a[0].outputs.data, a[1].outputs.data, rtol=0, atol=0)
    with pytest.raises(ValueError, match="multi_modal_data"):
        emb.embed(TextPrompt(prompt="x", multi_modal_data={"image": None}))  # type: ignore[typeddict-unknown-key]
    del emb
    gen = LLM(tiny_llama_causal, **KW)
    from pagedllm import SamplingParams
    sp = SamplingParams(max_tokens=3, temperature=0)
    g = gen.generate([TextPrompt(prompt=TEXTS[0]), TokensPrompt(prompt_token_ids=smollm2_tokenizer.encode(TEXTS[0]))],
                     sp, use_tqdm=False)
    assert g[0].outputs[0].token_ids == g[1].outputs[0].token_ids and len(g[0].outputs[0].token_ids) == 3
    del gen
    cls = LLM(tiny_qwen2_cls1, runner="pooling", **KW)
    s1 = cls.score("what is a cat?", "a small furry animal", use_tqdm=False)[0].outputs.score
    s2 = cls.score(TextPrompt(prompt="what is a cat?"), TextPrompt(prompt="a small furry animal"),
                   use_tqdm=False)[0].outputs.score
    assert s1 == s2


# ---------------------------------------------------------------------------------------- served
def _serve(engine, body, **args):
    import argparse

    from pagedllm.entrypoints.openai.api_server import build_app

    ns = argparse.Namespace(served_model_name=["tiny"], disable_log_requests=True, disable_log_stats=True, **args)
    return run_in_process(lambda: build_app(engine, ns), body, engine.shutdown)


def _vec(d):
    e = d["embedding"] if "embedding" in d else d["data"]
    if isinstance(e, str):
        return torch.from_numpy(np.frombuffer(base64.b64decode(e), dtype="<f4").copy())
    return torch.tensor(e)


def test_served_embed_activation(tiny_llama_causal, hf_causal, smollm2_tokenizer, caplog, monkeypatch):
    import pagedllm.pooling_params as pp
    monkeypatch.setattr(pp, "_warned_aliases", set())
    # the recipe's --pooler-config, as the server gets it from the command line
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=tiny_llama_causal, runner="pooling", convert="embed",
        pooler_config={"pooling_type": "LAST", "use_activation": False}, **KW))
    ids = [smollm2_tokenizer.encode(t) for t in TEXTS]
    ref = [_hidden(hf_causal, i) for i in ids]

    async def body(client):
        r = await client.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"},
                              headers={"X-Request-Id": "emb-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "emb-1" and r.json()["id"] == "embd-emb-1"
        for d, h in zip(r.json()["data"], ref):
            _close(_vec(d), h[-1])
        r = await client.post("/v1/embeddings", json={"input": TEXTS, "use_activation": True})
        assert r.headers["x-request-id"] == r.json()["id"]
        for d, h in zip(r.json()["data"], ref):
            _close(_vec(d), F.normalize(h[-1], dim=-1))
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            r = await client.post("/v1/embeddings", json={"input": TEXTS, "normalize": True})
        assert "`normalize` is deprecated" in caplog.text
        for d, h in zip(r.json()["data"], ref):
            _close(_vec(d), F.normalize(h[-1], dim=-1))
        r = await client.post("/pooling", json={"input": TEXTS, "task": "token_embed"})
        for d, h in zip(r.json()["data"], ref):
            _close(_vec(d), h)
        r = await client.post("/pooling", json={"input": TEXTS[:1], "task": "embed", "use_activation": True})
        _close(_vec(r.json()["data"][0]), F.normalize(ref[0][-1], dim=-1))
        # errors: contradicting alias, dimensions on a model that is not Matryoshka-trained
        r = await client.post("/v1/embeddings", json={"input": "x", "use_activation": True, "normalize": False})
        assert r.status_code == 400 and "conflicting" in r.json()["error"]["message"]
        r = await client.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
        e = r.json()["error"]
        assert r.status_code == 400 and "matryoshka" in e["message"] and e["param"] == "dimensions", e
        return True

    assert _serve(engine, body)


def test_served_classify_activation(tiny_llama_cls3, hf_cls3):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_cls3, runner="pooling", **KW))
    w = hf_cls3.score.weight.float()

    async def body(client):
        for extra, act in (({}, True), ({"use_activation": False}, False), ({"softmax": False}, False),
                           ({"activation": False}, False)):
            r = await client.post("/classify", json={"input": TEXTS, **extra})
            assert r.status_code == 200, r.text
            outs = r.json()["data"]
            for t, d in zip(TEXTS, outs):
                ids = engine.tokenizer.encode(t)
                with torch.no_grad():
                    logits = hf_cls3(torch.tensor([ids])).logits[0]
                _close(torch.tensor(d["probs"]), logits.softmax(-1) if act else logits)
        r = await client.post("/pooling", json={"input": TEXTS[1], "task": "token_classify"})
        ids = engine.tokenizer.encode(TEXTS[1])
        with torch.no_grad():
            logits = hf_cls3.model(torch.tensor([ids])).last_hidden_state[0] @ w.T
        _close(_vec(r.json()["data"][0]), logits.softmax(-1))
        r = await client.post("/pooling", json={"input": TEXTS[1], "task": "token_classify", "use_activation": False})
        _close(_vec(r.json()["data"][0]), logits)
        return True

    assert _serve(engine, body)
