"""Prompt embeddings (``enable_prompt_embeds``, vLLM's ``EmbedsPrompt`` / ``prompt_embeds``) on a
tiny random Llama: greedy output from ``prompt_embeds = embed_tokens(ids)`` equals the output from
``ids`` (whole prefill, chunked prefill, mixed batches, served through /v1/completions as base64
of a ``torch.save``'d tensor); the prefix cache never aliases an embeddings prompt with a token
prompt (placeholder ids) nor with other embeddings; bad tensors and a disabled engine are errors
naming ``prompt_embeds`` (400 served)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import io

import httpx
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs

KW = dict(dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1, max_model_len=128, block_size=4)
IDS = [1, 5, 9, 33, 70, 12, 8, 100, 3, 4, 61]
SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random Llama (vocab 256, hidden 64, 2 layers) with a word-level tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = str(tmp_path_factory.mktemp("pe_tiny"))
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # spread logits: stable greedy picks
    hf.save_pretrained(d)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # a 6-token budget: an 11-token prompt is prefilled in two chunks
    return LLM(tiny_dir, enable_prompt_embeds=True, max_num_batched_tokens=6, **KW)


def _embed(llm, ids):
    w = llm.llm_engine.core.model.model.embed_tokens.weight
    return w[torch.tensor(ids)].detach().clone()


def _toks(out):
    return list(out.outputs[0].token_ids)


def test_embeds_equal_tokens_chunked_and_mixed(llm):
    ref = llm.generate({"prompt_token_ids": IDS}, SP, use_tqdm=False)[0]
    e = _embed(llm, IDS)
    got = llm.generate({"prompt_embeds": e}, SP, use_tqdm=False)[0]
    assert _toks(got) == _toks(ref)
    # NOTE: the word-level decoder puts a space between the prompt's last word and the first output
    # word; an embeddings prompt has no words before the output
    assert got.outputs[0].text == ref.outputs[0].text.lstrip()
    assert got.prompt_token_ids == []  # no token ids to report
    # a batch of both kinds; a leading batch dimension of 1 and bfloat16 input are accepted
    other = [7, 8, 9, 10, 11]
    ref2 = llm.generate({"prompt_token_ids": other}, SP, use_tqdm=False)[0]
    outs = llm.generate([{"prompt_embeds": _embed(llm, other).unsqueeze(0)}, {"prompt_token_ids": IDS},
                         {"prompt_embeds": e}], SP, use_tqdm=False)
    assert [_toks(o) for o in outs] == [_toks(ref2), _toks(ref), _toks(ref)]
    bf = llm.generate({"prompt_embeds": e.to(torch.bfloat16)}, SP, use_tqdm=False)[0]
    assert len(bf.outputs[0].token_ids) == 8  # cast to the model dtype (values rounded: may differ)


def test_prefix_cache_never_aliases(llm):
    n = 12  # three full blocks of 4
    zeros = llm.generate({"prompt_token_ids": [0] * n}, SP, use_tqdm=False)[0]  # the placeholder ids
    e = torch.randn(n, 64) * 0.5
    first = llm.generate({"prompt_embeds": e}, SP, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0  # not the cached [0] * 12 blocks
    again = llm.generate({"prompt_embeds": e.clone()}, SP, use_tqdm=False)[0]
    assert again.num_cached_tokens == 8 and _toks(again) == _toks(first)  # same embeddings: shared
    e2 = e.clone()
    e2[-1, 0] += 1.0  # differs in the last row only: still no block shared (the digest is on block 0)
    third = llm.generate({"prompt_embeds": e2}, SP, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0
    assert _toks(zeros) != _toks(first) or _toks(first) != _toks(third)  # really different prompts


@pytest.mark.parametrize("bad, msg", [
    (torch.zeros(4, 5), "hidden size is 64"),
    (torch.zeros(4, 64, dtype=torch.int64), "floating-point"),
    (torch.zeros(2, 4, 64), "shape"),
    (torch.full((4, 64), float("nan")), "NaN"),
    (torch.zeros(0, 64), "empty"),
    ([[0.0] * 64], "torch.Tensor"),
    (torch.zeros(200, 64), "maximum context length"),
])
def test_bad_embeds(llm, bad, msg):
    with pytest.raises(ValueError, match=msg) as ei:
        llm.generate({"prompt_embeds": bad}, SP, use_tqdm=False)
    assert getattr(ei.value, "param", None) == "prompt_embeds"


def test_prompt_logprobs_refused_and_disabled_engine(llm, tiny_dir):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(max_tokens=2, prompt_logprobs=1),
                     use_tqdm=False)
    off = LLM(tiny_dir, **KW)
    with pytest.raises(ValueError, match="enable-prompt-embeds") as ei:
        off.generate({"prompt_embeds": torch.zeros(3, 64)}, SP, use_tqdm=False)
    assert ei.value.param == "prompt_embeds"
    with pytest.raises(ValueError, match="enable_prompt_embeds: needs the in-process worker"):
        LLM(tiny_dir, enable_prompt_embeds=True, distributed_executor_backend="mp", **KW)


def b64_tensor(t: torch.Tensor) -> str:
    """vLLM's encoding of ``prompt_embeds``: base64 of ``torch.save(t)``."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_served_prompt_embeds(tiny_dir, llm):
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    ref = _toks(llm.generate({"prompt_token_ids": IDS}, SP, use_tqdm=False)[0])
    e = _embed(llm, IDS)
    ns = argparse.Namespace(served_model_name=["tiny"], disable_log_requests=True, disable_log_stats=True)

    async def run(engine, body):
        transport = httpx.ASGITransport(app=build_app(engine, ns))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await body(client)

    async def enabled(client):
        base = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = await client.post("/v1/completions", json={**base, "prompt": IDS})
        assert r.json()["choices"][0]["token_ids"] == ref
        r = await client.post("/v1/completions", json={**base, "prompt_embeds": b64_tensor(e)})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == ref and body["usage"]["prompt_tokens"] == len(IDS)
        # a list of embeddings and a text prompt: the embeddings prompts first (vLLM's order)
        r = await client.post("/v1/completions", json={**base, "prompt_embeds": [b64_tensor(e), b64_tensor(e[:5])],
                                                       "prompt": [IDS[:5]]})
        ch = r.json()["choices"]
        assert [c["token_ids"] for c in ch][0] == ref and ch[1]["token_ids"] == ch[2]["token_ids"]
        for bad, frag in [("not base64!", "base64"), (base64.b64encode(b"junk").decode(), "torch.save"),
                          (b64_tensor(e[:, :10]), "hidden size"), (b64_tensor(e.long()), "floating-point"),
                          (b64_tensor(e * float("inf")), "NaN or infinite")]:
            r = await client.post("/v1/completions", json={**base, "prompt_embeds": bad})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "prompt_embeds" and frag in err["message"], err
        r = await client.post("/v1/completions", json={**base, "prompt_embeds": b64_tensor(e), "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        r = await client.post("/v1/completions", json={"max_tokens": 2})
        assert r.status_code == 400 and "prompt_embeds" in r.json()["error"]["message"]
        return True

    async def disabled(client):
        r = await client.post("/v1/completions", json={"prompt_embeds": b64_tensor(e), "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt_embeds" and "--enable-prompt-embeds" in err["message"]
        return True

    for flag, body in ((True, enabled), (False, disabled)):
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_dir, enable_prompt_embeds=flag, **KW))
        try:
            assert asyncio.run(run(engine, body))
        finally:
            engine.shutdown()


def test_transformers_backend_embeds(tiny_dir):
    """The transformers fallback (``model_impl="transformers"``) takes them as ``inputs_embeds``."""
    llm = LLM(tiny_dir, enable_prompt_embeds=True, model_impl="transformers", max_num_batched_tokens=6, **KW)
    ref = llm.generate({"prompt_token_ids": IDS}, SP, use_tqdm=False)[0]
    w = llm.llm_engine.core.model.decoder.get_input_embeddings().weight
    got = llm.generate({"prompt_embeds": w[torch.tensor(IDS)].detach().clone()}, SP, use_tqdm=False)[0]
    assert _toks(got) == _toks(ref)
