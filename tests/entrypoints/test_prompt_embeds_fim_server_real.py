"""The real SmolLM2 served with ``--enable-prompt-embeds``: a completion from ``prompt_embeds``
(base64 of ``torch.save(embed_tokens(ids))``) equals the completion from the same ``ids``; and
``suffix`` / ``/infill`` answer 400 naming the field (SmolLM2's tokenizer has no FIM tokens)."""
from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from server_helpers import serve

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def test_prompt_embeds_equal_tokens_and_no_fim(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    table = smollm2_llm.llm_engine.core.model.model.embed_tokens.weight
    buf = io.BytesIO()
    torch.save(table[torch.tensor(ids)].detach().clone(), buf)
    b64 = base64.b64encode(buf.getvalue()).decode()
    base = {"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    with serve([MODEL, "--dtype", "float32", "--quantization", "none", "--enable-prompt-embeds",
                "--max-model-len", "512", "--kv-cache-memory", str(64 * 1024**2), "--disable-log-stats"]) as (url, _):
        ref = httpx.post(url + "/v1/completions", json={**base, "prompt": ids}, timeout=120).json()["choices"][0]
        r = httpx.post(url + "/v1/completions", json={**base, "prompt_embeds": b64}, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]
        assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"] and "Paris" in got["text"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        buf = io.BytesIO()
        torch.save(torch.zeros(3, 100), buf)
        r = httpx.post(url + "/v1/completions", json={**base, "prompt_embeds": base64.b64encode(buf.getvalue()).decode()})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds" and "576" in r.text
        r = httpx.post(url + "/v1/completions", json={**base, "prompt": "def f(", "suffix": "return x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
        r = httpx.post(url + "/infill", json={"input_prefix": "def f(", "input_suffix": "return x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix", r.text
