"""Tiny random *ForSequenceClassification checkpoints: classify / score vs transformers; offline API errors."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams

TEXTS = ["hello world", "the cat sat on the mat and looked at the dog for a long time", "ok"]
KW = dict(runner="pooling", dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1)


def _hf(path):
    import transformers
    return transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ["tiny_llama_cls3", "tiny_qwen2_cls1"])
def test_classify_matches_transformers(fixture, request, smollm2_tokenizer):
    path = request.getfixturevalue(fixture)
    hf = _hf(path)
    # chunked prefill (budget 8 < the longest input) must not change the result
    llm = LLM(path, max_num_batched_tokens=8, **KW)
    assert llm.llm_engine.core.model.lm_head is None
    outs = llm.classify(TEXTS, use_tqdm=False)
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    with torch.no_grad():
        for t, o, r in zip(TEXTS, outs, raw):
            enc = smollm2_tokenizer(t, return_tensors="pt")
            assert o.prompt_token_ids == enc["input_ids"][0].tolist()
            logits = hf(**enc).logits[0]
            act = torch.sigmoid(logits) if logits.numel() == 1 else logits.softmax(-1)
            torch.testing.assert_close(torch.tensor(o.outputs.probs), act, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(r.outputs.data, logits, rtol=1e-4, atol=1e-4)
    # padded HF batch (pools the last non-pad token) agrees too
    with torch.no_grad():
        smollm2_tokenizer.pad_token_id = 0
        enc = smollm2_tokenizer(TEXTS, return_tensors="pt", padding=True)
        torch.testing.assert_close(torch.stack([r.outputs.data for r in raw]), hf(**enc).logits,
                                   rtol=1e-4, atol=1e-4)


def test_score_cross_encoder_matches_transformers(tiny_qwen2_cls1, smollm2_tokenizer):
    hf = _hf(tiny_qwen2_cls1)
    llm = LLM(tiny_qwen2_cls1, **KW)
    q = "what is a cat?"
    docs = ["a small furry animal", "a programming language", "the capital of France"]
    one_n = llm.score(q, docs, use_tqdm=False)
    n_n = llm.score([q] * 3, docs, use_tqdm=False)
    one_one = llm.score(q, docs[1], use_tqdm=False)
    with torch.no_grad():
        ref = [float(torch.sigmoid(hf(**smollm2_tokenizer(q, d, return_tensors="pt")).logits[0, 0])) for d in docs]
    for got in (one_n, n_n):
        assert [o.outputs.score for o in got] == pytest.approx(ref, abs=1e-5)
    assert one_one[0].outputs.score == pytest.approx(ref[1], abs=1e-5)
    assert one_n[0].prompt_token_ids == smollm2_tokenizer(q, docs[0])["input_ids"]
    with pytest.raises(ValueError, match="text_1 has 2 inputs"):
        llm.score([q, q], docs)


def test_score_embed_model_is_cosine(tiny_llama_causal):
    # dimensions (below) needs a Matryoshka model (vLLM): declared through hf_overrides
    llm = LLM(tiny_llama_causal, convert="embed", hf_overrides={"is_matryoshka": True}, **KW)
    a, b = "red apples", ["green pears", "red apples"]
    embs = llm.embed([a] + b, use_tqdm=False)
    got = llm.score(a, b, use_tqdm=False)
    for e, g in zip(embs[1:], got):
        want = torch.nn.functional.cosine_similarity(embs[0].outputs.data, e.outputs.data, dim=0)
        assert g.outputs.score == pytest.approx(float(want), abs=1e-6)
    assert got[1].outputs.score == pytest.approx(1.0, abs=1e-5)
    # embeddings are L2-normalized by default; dimensions truncates before normalizing
    assert embs[0].outputs.data.norm() == pytest.approx(1.0, abs=1e-5)
    e8 = llm.embed(a, PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert len(e8) == 8
    raw = llm.encode(a, use_tqdm=False, pooling_task="encode")[0].outputs.data
    torch.testing.assert_close(torch.tensor(e8), torch.nn.functional.normalize(raw[:8], dim=0))


def test_offline_api_errors(tiny_llama_causal, tiny_llama_cls3):
    gen = LLM(tiny_llama_causal, dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1)
    for call in (lambda: gen.embed("hi"), lambda: gen.classify("hi"), lambda: gen.score("a", "b"),
                 lambda: gen.encode("hi")):
        with pytest.raises(ValueError, match="not a pooling model"):
            call()
    emb = LLM(tiny_llama_causal, convert="embed", max_model_len=16, **KW)
    from pagedllm import SamplingParams
    with pytest.raises(ValueError, match="runner='pooling' and does not generate"):
        emb.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty list"):
        emb.embed([])
    long_ids = list(range(1, 18))
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        emb.embed([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": long_ids}])
    # nothing was left in the engine by the failed call
    assert not emb.llm_engine.has_unfinished_requests()
    out = emb.embed({"prompt_token_ids": long_ids}, truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids[-5:]
    with pytest.raises(ValueError, match="does not support classification"):
        emb.classify("hi")
    # a classifier checkpoint without convert= is a classifier
    cls = LLM(tiny_llama_cls3, **KW)
    with pytest.raises(ValueError, match="does not support embeddings"):
        cls.embed("hi")
    with pytest.raises(ValueError, match="num_labels=3"):
        cls.score("a", "b")


def test_foreign_safetensors_file_is_named(tiny_llama_causal, tmp_path):
    """A head saved beside the encoder: unknown names and names colliding with the model's own
    (``norm.weight``) are an error naming the file; ignore_patterns skips it on purpose."""
    import shutil

    from safetensors.torch import save_file

    d = str(tmp_path / "enc")
    shutil.copytree(tiny_llama_causal, d)
    save_file({"norm.weight": torch.ones(64), "fc1.weight": torch.zeros(2, 64)}, f"{d}/head.safetensors")
    for runner in ("pooling", "generate"):
        with pytest.raises(ValueError) as ei:
            LLM(d, **{**KW, "runner": runner})
        msg = str(ei.value)
        assert "'head.safetensors'" in msg and "'fc1.weight'" in msg, msg
        assert "norm.weight (also in model.safetensors as model.norm.weight)" in msg, msg
        assert "ignore_patterns=['head.safetensors']" in msg, msg
    llm = LLM(d, ignore_patterns=["head.safetensors"], **KW)
    ref = LLM(tiny_llama_causal, **KW)
    a = llm.embed("hello", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(a, ref.embed("hello", use_tqdm=False)[0].outputs.data, rtol=0, atol=0)


def test_vllm_output_classes_reward_and_encode_task(tiny_llama_causal, tiny_llama_cls3):
    """vLLM's names: embed / classify / score return Embedding- / Classification- /
    ScoringRequestOutput (PoolingRequestOutput subclasses, importable from pagedllm); encode()
    without pooling_task is vLLM's ValueError; reward() is encode(pooling_task="token_classify")."""
    from pagedllm import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                          ScoringRequestOutput)
    emb = LLM(tiny_llama_causal, convert="embed", max_model_len=32, **KW)
    e = emb.embed(["hello world", "ok"], use_tqdm=False)
    assert all(type(o) is EmbeddingRequestOutput and isinstance(o, PoolingRequestOutput) for o in e)
    assert e[0].outputs.hidden_size == len(e[0].outputs.embedding) == 64
    s = emb.score("hello world", ["hello world", "ok"], use_tqdm=False)
    assert all(type(o) is ScoringRequestOutput for o in s) and s[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="pooling_task required"):
        emb.encode("hi")
    raw = emb.encode("hello world", pooling_task="encode", use_tqdm=False)[0]
    assert type(raw) is PoolingRequestOutput
    torch.testing.assert_close(torch.nn.functional.normalize(raw.outputs.data, dim=0), e[0].outputs.data)
    cls = LLM(tiny_llama_cls3, **KW)
    c = cls.classify(TEXTS, use_tqdm=False)
    assert all(type(o) is ClassificationRequestOutput for o in c) and c[0].outputs.num_classes == 3
    r = cls.reward(TEXTS, use_tqdm=False)
    tok = cls.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    for a, b, t in zip(r, tok, TEXTS):
        assert a.outputs.data.shape == (len(a.prompt_token_ids), 3)
        torch.testing.assert_close(a.outputs.data, b.outputs.data)


def test_num_labels_override(tiny_llama_cls3, smollm2_path):
    """hf_overrides num_labels: a count that disagrees with the checkpoint's classifier head is a
    clear ValueError (vLLM fails loading the head); on a GGUF's config it is set, not a crash."""
    with pytest.raises(ValueError, match="num_labels: the config says 2 labels .* head has 3 rows"):
        LLM(tiny_llama_cls3, hf_overrides={"num_labels": 2}, **KW)
    gguf = LLM(smollm2_path, hf_overrides={"num_labels": 3}, max_model_len=64, **KW)  # a GGUF's TextConfig
    cfg = gguf.llm_engine.model_config.hf_config
    assert cfg.num_labels == 3 and cfg.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    assert cfg.label2id["LABEL_2"] == 2
    assert len(gguf.embed("hello", use_tqdm=False)[0].outputs.embedding) == 576  # still an embedding model
