"""`pagedllm serve --speculative-config` on SmolLM2 (slow): chat completions through the openai
client equal the offline non-speculative greedy outputs (streamed and not), /metrics carries the
spec decode counters, and a bad --speculative-config stops start-up with a message naming it."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
from server_helpers import free_port, serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
TEXT = "The quick brown fox jumps over the lazy dog. All that glitters is not gold. " * 2
MESSAGES = [[{"role": "user", "content": "Repeat this text exactly: " + TEXT}],
            [{"role": "user", "content": "What is the capital of France?"}]]


def _serve(extra):
    port = free_port()
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return port, subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", MODEL, "--port", str(port),
         "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(256 * 1024**2),
         "--disable-log-stats", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def server():
    # like with like: the GGUF server against smollm2_llm (the same weights dequantized to float32)
    # is exact only with float activations (tests/spec_decode/test_spec_real.py, _float_activations)
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDLLM_GGUF_INTDOT", "0")
    try:
        with serve([MODEL, "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(256 * 1024**2),
                    "--disable-log-stats", "--speculative-config", SPEC]) as (base, _):
            yield base
    finally:
        mp.undo()


def test_chat_equals_offline_greedy_and_metrics(server, smollm2_llm):
    from openai import OpenAI

    from pagedllm import SamplingParams

    client = OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    offline = [o.outputs[0].text for o in smollm2_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=48),
                                                           use_tqdm=False)]
    for msgs, ref in zip(MESSAGES, offline):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
        assert r.choices[0].message.content == ref
        stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref
    text = httpx.get(server + "/metrics").text
    drafts = float(re.search(r"^pagedllm:spec_decode_num_drafts_total\{.*\} (\S+)$", text, re.M).group(1))
    accepted = float(re.search(r"^pagedllm:spec_decode_num_accepted_tokens_total\{.*\} (\S+)$", text, re.M).group(1))
    assert drafts > 0 and accepted > 0


def test_bad_speculative_config_fails_start_up():
    _, proc = _serve(["--speculative-config", '{"method": "ngram"}'])
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "num_speculative_tokens" in out
