"""Disaggregated prefill/decode through the real server: a P2pConnector kv_producer prefills, a
kv_consumer loads the KV over TCP and decodes, `pagedllm disagg-proxy` routes; the tokens equal one
instance's (greedy), streaming works, an abort or a decoder that never comes frees the producer's
staged blocks, a failed transfer recomputes, and the staging buffer stays within its bound."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
import transformers as tf

from server_helpers import free_port, serve

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32, 16 tokens
BUFFER_BLOCKS = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    """A tiny random LlamaForCausalLM checkpoint with SmolLM2's tokenizer."""
    from pagedllm.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    d = str(tmp_path_factory.mktemp("p2p_srv"))
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(7)
    m = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@contextlib.contextmanager
def _proxy(prefill: str, decode: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "disagg-proxy", "--prefill", prefill,
                             "--decode", decode, "--port", str(port)],
                            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError("proxy exited:\n" + proc.stdout.read())
        try:
            httpx.get(base + "/metrics", timeout=1)
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("proxy did not start") from None
            time.sleep(0.2)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """(producer URL, consumer URL, proxy URL, producer kv port)."""
    kv_port = free_port()
    common = [tiny_dir, "--served-model-name", "m", "--dtype", "float32", "--kv-cache-memory", str(96 * BLOCK_BYTES),
              "--max-num-batched-tokens", "128"]
    prod = json.dumps({"kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": kv_port,
                       "engine_id": "prefill-0",
                       "kv_connector_extra_config": {"buffer_bytes_to_use": BUFFER_BLOCKS * BLOCK_BYTES,
                                                     "abort_request_timeout_s": 3}})
    cons = json.dumps({"kv_connector": "P2pConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer_timeout_s": 5}})
    with serve(common + ["--kv-transfer-config", prod]) as (p, _), \
            serve(common + ["--kv-transfer-config", cons]) as (c, _), _proxy(p, c) as x:
        yield p, c, x, kv_port


def _metric(base: str, name: str, label: str | None = None) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{") and (label is None or label in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _prompt(seed: int, words: int) -> str:
    return " ".join(f"w{seed}x{i} t{(i * 7 + seed) % 13}" for i in range(words))


def _complete(base: str, prompt: str, **kw) -> dict:
    r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(fn, timeout: float = 20.0):
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > deadline:
            return v
        time.sleep(0.1)


def test_disaggregated_tokens_equal_one_instance(pair):
    prod, cons, proxy, _ = pair
    hit0 = _metric(cons, "pagedllm:kv_tier_hit_tokens_total")
    expected_hit = expected_sent = 0
    sent0 = _metric(prod, "pagedllm:kv_transfer_requests_total", 'event="sent"')
    for seed, words in ((1, 40), (2, 9), (3, 3)):
        prompt = _prompt(seed, words)
        want = _complete(prod, prompt, return_token_ids=True)  # one instance, nothing transferred
        got = _complete(proxy, prompt, return_token_ids=True)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        expected_hit += min((want["usage"]["prompt_tokens"] - 1) // 16, BUFFER_BLOCKS) * 16
        expected_sent += want["usage"]["prompt_tokens"] > 16  # a prompt within one block has nothing to send
    assert expected_hit >= 5 * 16
    assert _metric(cons, "pagedllm:kv_tier_hit_tokens_total") - hit0 == expected_hit
    assert _metric(cons, "pagedllm:kv_tier_load_bytes_total", 'tier="p2p_recv"') >= expected_hit // 16 * BLOCK_BYTES
    assert expected_sent == 3
    assert _metric(prod, "pagedllm:kv_transfer_requests_total", 'event="sent"') - sent0 == expected_sent
    # every transfer was fetched: the producer holds nothing
    assert _wait_for(lambda: _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') == 0)
    assert _metric(prod, "pagedllm:kv_tier_capacity_bytes", 'tier="p2p_send"') == BUFFER_BLOCKS * BLOCK_BYTES


def test_prefill_response_carries_kv_transfer_params(pair):
    prod, _, _, kv_port = pair
    body = _complete(prod, _prompt(4, 30), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    kv = body["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == kv_port and kv["remote_host"] == "127.0.0.1"
    assert kv["remote_engine_id"] == "prefill-0" and kv["remote_request_id"] == body["id"] + "-0"
    assert _complete(prod, _prompt(4, 2))["kv_transfer_params"] is None


def test_streaming_chat_through_proxy(pair):
    prod, _, proxy, _ = pair
    msgs = [{"role": "user", "content": _prompt(5, 35)}]
    want = httpx.post(prod + "/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 10,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60).json()
    text = ""
    with httpx.stream("POST", proxy + "/v1/chat/completions",
                      json={"model": "m", "messages": msgs, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                            "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
    assert text == want["choices"][0]["message"]["content"] and text


def test_abort_on_decoder_frees_producer_blocks(pair):
    prod, cons, _, _ = pair
    assert _wait_for(lambda: _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') == 0)
    prompt = _prompt(6, 40)
    kv = _complete(prod, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') > 0
    with httpx.stream("POST", cons + "/v1/completions",
                      json={"model": "m", "prompt": prompt, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
                            "stream": True, "kv_transfer_params": kv}, timeout=60) as r:
        next(r.iter_lines())  # started; then the client goes away
    assert _wait_for(lambda: _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') == 0)
    assert _wait_for(lambda: _metric(cons, "pagedllm:num_requests_running") == 0)


def test_unfetched_transfer_expires_after_timeout(pair):
    prod, _, _, _ = pair
    exp0 = _metric(prod, "pagedllm:kv_transfer_requests_total", 'event="expired"')
    _complete(prod, _prompt(7, 40), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') > 0
    assert _wait_for(lambda: _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') == 0)
    assert _metric(prod, "pagedllm:kv_transfer_requests_total", 'event="expired"') == exp0 + 1


def test_failed_transfer_recomputes(pair):
    prod, cons, _, _ = pair
    prompt = _prompt(8, 40)
    want = _complete(prod, prompt, return_token_ids=True)["choices"][0]["token_ids"]
    failed0 = _metric(cons, "pagedllm:kv_transfer_requests_total", 'event="failed"')
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
            "remote_request_id": "nope", "remote_engine_id": "x"}
    got = _complete(cons, prompt, return_token_ids=True, kv_transfer_params=dead)["choices"][0]["token_ids"]
    assert got == want
    assert _metric(cons, "pagedllm:kv_transfer_requests_total", 'event="failed"') == failed0 + 1


def test_staging_buffer_bound(pair):
    prod, cons, _, _ = pair
    assert _wait_for(lambda: _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') == 0)
    ev0 = _metric(prod, "pagedllm:kv_transfer_requests_total", 'event="evicted"')
    drop0 = _metric(prod, "pagedllm:kv_tier_dropped_blocks_total", 'tier="p2p_send"')
    long_prompt = _prompt(9, 90)  # > BUFFER_BLOCKS blocks: only a prefix is staged
    want = _complete(prod, long_prompt, return_token_ids=True)
    n_blocks = (want["usage"]["prompt_tokens"] - 1) // 16
    assert n_blocks > BUFFER_BLOCKS
    kv = _complete(prod, long_prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert _metric(prod, "pagedllm:kv_tier_bytes", 'tier="p2p_send"') == BUFFER_BLOCKS * BLOCK_BYTES
    assert _metric(prod, "pagedllm:kv_tier_dropped_blocks_total", 'tier="p2p_send"') > drop0
    # a second transfer evicts the first (oldest first) to stay within the bound
    kv2 = _complete(prod, _prompt(10, 40), max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert _metric(prod, "pagedllm:kv_tier_bytes", 'tier="p2p_send"') <= BUFFER_BLOCKS * BLOCK_BYTES
    assert _metric(prod, "pagedllm:kv_transfer_requests_total", 'event="evicted"') == ev0 + 1
    # the evicted transfer's decoder recomputes: same tokens
    got = _complete(cons, long_prompt, return_token_ids=True, kv_transfer_params=kv)
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    httpx.post(cons + "/v1/completions", json={"model": "m", "prompt": _prompt(10, 40), "max_tokens": 1,
                                              "kv_transfer_params": kv2}, timeout=60)
    assert _wait_for(lambda: _metric(prod, "pagedllm:kv_tier_blocks", 'tier="p2p_send"') == 0)
