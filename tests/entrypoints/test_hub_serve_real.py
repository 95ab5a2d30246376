"""Serving by Hub id end to end on the real SmolLM2: its weights as a sharded safetensors checkpoint (with a
stray file beside the index) in an offline Hugging Face cache, loaded by ``LLM("test-org/...")`` and by
``pagedllm serve test-org/...`` (subprocess, openai client); both match the GGUF model's greedy text."""
from __future__ import annotations

import json

import pytest
from hub_cache import add_snapshot
from server_helpers import serve

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow
REPO = "test-org/SmolLM2-135M-Instruct-hf"
PROMPTS = ["The capital of France is", "Once upon a time,"]


@pytest.fixture(scope="module")
def hub_cache(smollm2_path, tmp_path_factory):
    """The SmolLM2 GGUF's float32 weights saved as 2 safetensors shards + index (+ a stray
    ``consolidated.safetensors``), its config and tokenizer, cached as ``REPO``; returns the cache dir."""
    from safetensors.torch import save_file

    from pagedllm.loader import load_model

    lm = load_model(smollm2_path)
    src = tmp_path_factory.mktemp("smollm2-hf")
    cfg = lm.hf_config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    lm.tokenizer.save_pretrained(src)
    weights = {k: v.contiguous() for k, v in lm.weights()}
    names = sorted(weights)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, str(src / fname))
        weight_map.update({n: fname for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"model.norm.weight": weights["model.norm.weight"] * 0}, str(src / "consolidated.safetensors"))
    cache = tmp_path_factory.mktemp("hf-cache")
    add_snapshot(str(cache), REPO, str(src))
    return str(cache)


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _texts(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_llm_by_hub_id_matches_the_gguf(offline, smollm2_llm):
    llm = LLM(REPO, dtype="float32", kv_cache_memory=64 * 1024**2)
    assert llm.llm_engine.core.loaded.repo_id == REPO
    assert _texts(llm) == _texts(smollm2_llm)


def test_serve_by_hub_id(offline, smollm2_llm):
    from openai import OpenAI

    with serve([REPO, "--dtype", "float32", "--kv-cache-memory", str(64 * 1024**2), "--max-model-len", "512",
                "--disable-log-stats"]) as (base, _):
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [REPO]
        got = [client.completions.create(model=REPO, prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in PROMPTS]
        assert got == _texts(smollm2_llm)
