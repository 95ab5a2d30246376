"""One input path (issue 16 part 3) on the real SmolLM2: the offline ``LLM`` and the server (the
real ``AsyncLLM`` behind ``build_app``) give the same prompt token ids, the same greedy tokens and
the same error messages for the same inputs."""
from __future__ import annotations

import os
import sys

import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from api_helpers import make_args  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KW = dict(dtype="float32", num_threads=1, kv_cache_memory="64MiB", max_model_len=256)

# ChatML like SmolLM2's, plus the tools and the assistant's tool calls (arguments through tojson).
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
            "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
CONV = [
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24 C"},
]


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, **KW)


@pytest.fixture(scope="module")
def client():
    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, **KW))
    try:
        with TestClient(build_app(engine, make_args())) as c:
            yield c
    finally:
        engine.shutdown()


def test_chat_same_ids_and_tokens(offline, client):
    """A conversation with a developer message, tools and a tool-call turn: LLM.chat and
    /v1/chat/completions render, tokenize and generate alike (offline passed the arguments as
    JSON text before, the server as an object)."""
    sp = SamplingParams(temperature=0, max_tokens=6)
    (off,) = offline.chat(CONV, sp, use_tqdm=False, chat_template=TEMPLATE, tools=[WEATHER])
    r = client.post("/v1/chat/completions", json={
        "messages": CONV, "chat_template": TEMPLATE, "tools": [WEATHER], "tool_choice": "none",
        "temperature": 0, "max_completion_tokens": 6, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == off.prompt_token_ids
    assert body["usage"]["prompt_tokens"] == len(off.prompt_token_ids)
    assert body["choices"][0]["token_ids"] == off.outputs[0].token_ids
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in off.prompt
    assert "<|im_start|>system\nAnswer in one word." in off.prompt  # developer -> system


def test_same_errors(offline, client):
    sp = SamplingParams(temperature=0, max_tokens=4)
    cases = [
        ({"prompt": [1, 10**6]}, {"prompt_token_ids": [1, 10**6]}, sp, "prompt"),
        ({"prompt": "hi " * 400}, "hi " * 400, sp, "prompt"),
        ({"prompt": "hi", "logprobs": 21}, "hi", SamplingParams(max_tokens=4, logprobs=21), "logprobs"),
        ({"prompt": "hi", "truncate_prompt_tokens": 300}, "hi",
         SamplingParams(max_tokens=4, truncate_prompt_tokens=300), "truncate_prompt_tokens"),
    ]
    for body, prompt, params, param in cases:
        r = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        with pytest.raises(ValueError) as e:
            offline.generate(prompt, params, use_tqdm=False)
        assert str(e.value) == r.json()["error"]["message"] + " (prompt index 0)"
    assert not offline.llm_engine.has_unfinished_requests()


def test_truncated_prompt_same_text_and_tokens(offline, client):
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest"
    (off,) = offline.generate(text, SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=6),
                              use_tqdm=False)
    assert len(off.prompt_token_ids) == 6 and off.prompt == offline.get_tokenizer().decode(off.prompt_token_ids)
    r = client.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 6, "max_tokens": 5,
                                             "temperature": 0, "echo": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["prompt_token_ids"] == off.prompt_token_ids and c["token_ids"] == off.outputs[0].token_ids
    assert c["text"] == off.prompt + off.outputs[0].text


def test_duplicate_request_id_leaves_the_running_request_alone():
    """The real engine behind the app: a request reusing the X-Request-Id of one in flight runs
    too (a suffixed engine id), and the running request (non-streamed and streamed) still returns
    all its tokens (the duplicate's cleanup used to abort the shared engine id: the first request
    then hung)."""
    import asyncio
    import json

    from server_helpers import run_in_process

    engine = AsyncLLM.from_engine_args(EngineArgs(model=MODEL, **KW))

    async def body(client):
        got = []
        for stream in (False, True):
            rid = f"dup{int(stream)}"
            first = asyncio.ensure_future(client.post("/v1/completions", headers={"X-Request-Id": rid}, json={
                "model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": stream}))
            for _ in range(2000):
                if f"cmpl-{rid}-0" in engine._ids_in_use:
                    break
                await asyncio.sleep(0.005)
            assert f"cmpl-{rid}-0" in engine._ids_in_use
            second = await client.post("/v1/completions", headers={"X-Request-Id": rid},
                                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert second.status_code == 200 and second.json()["id"] == f"cmpl-{rid}", second.text
            assert second.json()["usage"]["completion_tokens"] == 2
            r = await asyncio.wait_for(first, timeout=60)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(b[len("data: "):]) for b in r.text.split("\n\n")
                          if b.startswith("data: {")]
                assert events[-1]["choices"][0]["finish_reason"] == "length"
                got.append(sum(len(e["choices"][0]["text"]) > 0 for e in events))
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
                assert r.json()["choices"][0]["finish_reason"] == "length"
        return got

    got = run_in_process(lambda: build_app(engine, make_args()), body, engine.shutdown)
    assert got and got[0] >= 12  # the streamed request's text came in many chunks


def test_anthropic_stream_reports_the_same_cached_tokens_at_start_and_end(client):
    """/v1/messages streamed twice with the same long system prompt: the second reads the prompt's
    blocks from the prefix cache, and message_start reports the same cache_read_input_tokens as
    message_delta (message_start used to say 0)."""
    import json

    body = {"model": MODEL, "max_tokens": 3, "stream": True,
            "system": "You are a careful assistant who answers in one short sentence. " * 6,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    usages = []
    for _ in range(2):
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        events = {}
        for block in r.text.split("\n\n"):
            lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
            if "event" in lines:
                events.setdefault(lines["event"], json.loads(lines["data"]))
        usages.append((events["message_start"]["message"]["usage"]["cache_read_input_tokens"],
                       events["message_delta"]["usage"]["cache_read_input_tokens"]))
    assert usages[1][0] == usages[1][1] >= 16, usages
    assert usages[0][0] == usages[0][1]
