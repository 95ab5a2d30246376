"""The disk KV tier through the real server: a prefix computed by one server is loaded, not
recomputed, by the next server on the same --kv-cache-dir (same output); /metrics counts it."""
from __future__ import annotations

import os
import re

import httpx
import pytest

from server_helpers import serve
from tiny_models import TINY_LLAMA_BLOCK_BYTES as BLOCK_BYTES


@pytest.fixture(scope="module")
def tiny_dir(tiny_smollm2_llama_dir):
    """A tiny random LlamaForCausalLM checkpoint with SmolLM2's tokenizer."""
    return tiny_smollm2_llama_dir


def _metric(text: str, name: str, tier: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and (tier is None or f'tier="{tier}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _complete(base: str, prompt: str) -> tuple[str, int]:
    r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens"]


def test_disk_tier_survives_a_server_restart(tiny_dir, tmp_path):
    d = str(tmp_path / "kv")
    prompt = " ".join(f"word{i} alpha{i * 7 % 13}" for i in range(40))
    common = [tiny_dir, "--served-model-name", "m", "--dtype", "float32", "--kv-cache-memory", str(40 * BLOCK_BYTES),
              "--max-num-batched-tokens", "128"]
    with serve(common + ["--kv-cache-dir", d, "--kv-offloading-size", "0.01"]) as (base, _):
        first, n_prompt = _complete(base, prompt)
        m = httpx.get(base + "/metrics").text
        assert _metric(m, "pagedllm:kv_tier_hit_tokens_total") == 0
        assert _metric(m, "pagedllm:kv_tier_capacity_bytes", "host") == int(0.01 * 1024**3)
    n_blocks = (n_prompt - 1) // 16
    assert n_blocks >= 4
    files = [f for _, _, fs in os.walk(d) for f in fs]
    assert len(files) >= n_blocks and not [f for f in files if f.endswith(".tmp")]
    # a new server, configured through vLLM's JSON flag
    cfg = ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
           f'"kv_connector_extra_config": {{"kv_cache_dir": "{d}"}}}}')
    with serve(common + ["--kv-transfer-config", cfg]) as (base, _):
        again, _ = _complete(base, prompt)
        m = httpx.get(base + "/metrics").text
        assert again == first
        assert _metric(m, "pagedllm:kv_tier_hit_tokens_total") == n_blocks * 16
        assert _metric(m, "pagedllm:kv_tier_load_blocks_total", "disk") == n_blocks
        assert _metric(m, "pagedllm:kv_tier_errors_total", "disk") == 0
        assert _metric(m, "pagedllm:kv_tier_blocks", "disk") >= n_blocks
        assert re.search(r'pagedllm:kv_tier_load_seconds_total\{model_name="m"\} [0-9.e-]+', m)
