"""Fill-in-the-middle: ``suffix`` in /v1/completions and llama.cpp's ``/infill`` on tiny random
Llama checkpoints whose word-level tokenizers carry the FIM tokens of one family (Qwen2.5-Coder,
StarCoder2, CodeLlama with a BOS post-processor), and a 400 naming the field for a tokenizer
without them. Each test asserts the exact prompt ids the engine received (``return_token_ids``)
and that the served completion is the offline greedy continuation of those ids."""
from __future__ import annotations

import argparse
import asyncio
import json
import os

import httpx
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.fim import encode_fim, fim_tokens

KW = dict(dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1, max_model_len=128)
FAMILIES = {
    "qwen": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"],
    "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"],
    "codellama": ["▁<PRE>", "▁<SUF>", "▁<MID>"],
    "none": [],
}


def _tokenizer(special: list[str], bos: bool):
    """Word-level tokenizer, 256 ids: ``<unk> <s> </s>``, the FIM tokens, then words w0...;
    ``bos``: a post-processor puts ``<s>`` first (CodeLlama style)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + special
    words += [f"w{i}" for i in range(256 - len(words))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def fim_dirs(tmp_path_factory):
    """family -> checkpoint dir (one random Llama, vocab 256, hidden 64, 2 layers)."""
    import transformers as tf

    root = tmp_path_factory.mktemp("fim")
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    out = {}
    for fam, special in FAMILIES.items():
        d = os.path.join(str(root), fam)
        hf.save_pretrained(d)
        _tokenizer(special, bos=fam == "codellama").save_pretrained(d)
        out[fam] = d
    return out


def _serve(model_dir, body):
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **KW))
    ns = argparse.Namespace(served_model_name=["tiny"], disable_log_requests=True, disable_log_stats=True)

    async def main():
        transport = httpx.ASGITransport(app=build_app(engine, ns))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await body(client, engine)
    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def _offline_greedy(model_dir, ids, n):
    from pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, **KW)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def test_fim_token_detection(fim_dirs):
    from transformers import AutoTokenizer

    got = {f: fim_tokens(AutoTokenizer.from_pretrained(d)) for f, d in fim_dirs.items()}
    assert got["none"] is None
    assert (got["qwen"].family, got["qwen"].prefix, got["qwen"].suffix, got["qwen"].middle,
            got["qwen"].repo, got["qwen"].file_sep) == ("qwen", 3, 4, 5, 6, 7)
    assert got["starcoder"].family == "starcoder" and got["starcoder"].repo == 6
    assert (got["codellama"].family, got["codellama"].prefix, got["codellama"].repo) == ("codellama", 3, None)


@pytest.mark.parametrize("family", ["qwen", "codellama"])
def test_suffix_completion_prompt_ids(fim_dirs, family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fim_dirs[family])
    w = tok.get_vocab()
    pre, suf, mid = 3, 4, 5
    # the exact layout: [BOS] <PRE> prefix <SUF> suffix <MID>
    expected = ([1] if family == "codellama" else []) + [pre, w["w10"], w["w11"], suf, w["w12"], mid]
    assert encode_fim(tok, "w10 w11", "w12") == expected
    ref_ids, ref_text = _offline_greedy(fim_dirs[family], expected, 6)

    async def body(client, engine):
        r = await client.post("/v1/completions", json={"prompt": "w10 w11", "suffix": "w12", "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True,
                                                       "return_token_ids": True})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["prompt_token_ids"] == expected  # what the engine computed
        assert c["token_ids"] == ref_ids and c["text"] == ref_text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        # add_special_tokens=false drops the BOS only
        r = await client.post("/v1/completions", json={"prompt": "w10 w11", "suffix": "w12", "max_tokens": 1,
                                                       "add_special_tokens": False, "return_token_ids": True})
        assert r.json()["choices"][0]["prompt_token_ids"] == [pre, w["w10"], w["w11"], suf, w["w12"], mid]
        # Ollama's /api/generate suffix: the same layout, no chat template
        r = await client.post("/api/generate", json={"model": "tiny", "prompt": "w10 w11", "suffix": "w12",
                                                     "stream": False, "options": {"num_predict": 2}})
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == len(expected), r.text
        # a token-id prompt cannot be split around a gap
        r = await client.post("/v1/completions", json={"prompt": [10, 11], "suffix": "w12"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
        return True

    assert _serve(fim_dirs[family], body)


def test_infill_route_repo_layout_and_stream(fim_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fim_dirs["starcoder"])
    w = tok.get_vocab()
    extra = [{"filename": "w1", "text": "w2 w3"}]
    ids = encode_fim(tok, "w10", "w11", middle="w12", extra=extra)
    # <repo_name> myproject\n <file_sep> w1\nw2 w3 <file_sep> filename\n <PRE> w10 <SUF> w11 <MID> w12;
    # the word tokenizer knows neither "myproject" nor "filename" (<unk> = 0)
    assert ids == [6, 0, 7, w["w1"], w["w2"], w["w3"], 7, 0, 3, w["w10"], 4, w["w11"], 5, w["w12"]]
    ref_ids, ref_text = _offline_greedy(fim_dirs["starcoder"], ids, 5)

    async def body(client, engine):
        req = {"input_prefix": "w10", "input_suffix": "w11", "prompt": "w12", "input_extra": extra,
               "n_predict": 5, "temperature": 0, "return_tokens": True}
        r = await client.post("/infill", json=req)
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["tokens"] == ref_ids and b["content"] == ref_text and b["stop"] is True
        assert b["tokens_evaluated"] == len(ids) and b["tokens_predicted"] == 5 and b["stop_type"] in ("limit", "eos")
        r = await client.post("/infill", json={**req, "stream": True})
        events = [json.loads(x[len("data: "):]) for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
        assert "".join(e["content"] for e in events[:-1]) == ref_text
        assert [t for e in events[:-1] for t in e["tokens"]] == ref_ids
        r = await client.post("/infill", json={**req, "input_extra": [{"text": 5}]})
        assert r.status_code == 400, r.text
        return True

    assert _serve(fim_dirs["starcoder"], body)


def test_no_fim_tokens_400(fim_dirs):
    async def body(client, engine):
        r = await client.post("/v1/completions", json={"prompt": "w10", "suffix": "w11"})
        e = r.json()["error"]
        assert r.status_code == 400 and e["param"] == "suffix" and "fill-in-the-middle" in e["message"], e
        r = await client.post("/infill", json={"input_prefix": "w10", "input_suffix": "w11"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix", r.text
        r = await client.post("/api/generate", json={"model": "tiny", "prompt": "w10", "suffix": "w11",
                                                     "stream": False})
        assert r.status_code == 400 and "suffix" in r.text, r.text
        # no suffix (or an empty one): a plain completion
        r = await client.post("/v1/completions", json={"prompt": "w10", "suffix": "", "max_tokens": 2})
        assert r.status_code == 200, r.text
        return True

    assert _serve(fim_dirs["none"], body)
