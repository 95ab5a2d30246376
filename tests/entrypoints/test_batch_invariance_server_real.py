"""Issue 16 part 2 on the real SmolLM2 through the server: ``/v1/completions`` at temperature 0 with
a ~600-token prompt (a 30-line list document and a question) returns the same completion and the
same logprobs, to the last bit, alone, after a sibling prompt sharing the document was served (a
prefix-cache hit), and inside a batch of concurrent requests (chunked prefill mixed with decodes),
with ``--batch-invariant`` (default dtype: bf16 on CPUs with native bf16 matmul, else float32)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from server_helpers import serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
COLORS = ["red", "blue", "green", "amber", "violet"]
DOC = "\n".join(f"{i + 1}. The {COLORS[i % 5]} box on shelf {(i * 7) % 13} holds {i * 3 + 2} brass keys."
                for i in range(30))
# NOTE: SmolLM2's ChatML turn markers written out, so that the instruct model answers (a bare
# question gets an immediate end-of-turn) while the request stays a plain completion.
USER = "<|im_start|>user\nHere is an inventory list:\n"
QUESTION = "\n\nWhich box holds 47 brass keys, and on which shelf is it?<|im_end|>\n<|im_start|>assistant\n"
SIBLING = "\n\nHow many brass keys are in the box on shelf 5?<|im_end|>\n<|im_start|>assistant\n"
OTHERS = ["Write a haiku about autumn leaves.", "The quick brown fox", "List three prime numbers:",
          "Explain why the sky is blue in one sentence."]


@pytest.fixture(scope="module")
def server():
    # NOTE: the first start compiles the batch-invariant kernels
    with serve([MODEL, "--batch-invariant", "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                "--max-num-batched-tokens", "256", "--disable-log-stats"], timeout=900) as (base, _):
        yield base


async def _complete(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int = 24) -> dict:
    r = await client.post(base + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5}, timeout=600)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    return {"text": choice["text"], "tokens": lp["tokens"], "token_logprobs": lp["token_logprobs"],
            "top_logprobs": lp["top_logprobs"], "usage": r.json()["usage"]}


def test_greedy_completion_bitwise_alone_after_sibling_in_batch(server):
    async def scenario():
        async with httpx.AsyncClient() as client:
            alone = await _complete(client, server, USER + DOC + QUESTION)
            assert 500 <= alone["usage"]["prompt_tokens"] <= 700
            again = await _complete(client, server, USER + DOC + QUESTION)  # now a prefix-cache hit on itself
            await _complete(client, server, USER + DOC + SIBLING, max_tokens=8)
            after_sibling = await _complete(client, server, USER + DOC + QUESTION)
            batch = await asyncio.gather(*[_complete(client, server, p, max_tokens=m) for p, m in
                                           [(OTHERS[0], 30), (USER + DOC + SIBLING, 12), (USER + DOC + QUESTION, 24),
                                            (OTHERS[1], 20), (OTHERS[2], 16), (OTHERS[3], 40)]])
            return alone, again, after_sibling, batch[2]

    alone, again, after_sibling, in_batch = asyncio.run(scenario())
    assert alone["text"].strip()
    for name, got in [("again", again), ("after sibling", after_sibling), ("in batch", in_batch)]:
        assert got["text"] == alone["text"], name
        # the logprobs are float32 values serialized as JSON floats: equal numbers = equal bits
        assert got["token_logprobs"] == alone["token_logprobs"], name
        assert got["top_logprobs"] == alone["top_logprobs"], name
