"""The Ollama-compatible routes (/api/...) on the fake engines: options -> SamplingParams, NDJSON
streaming, prompts (chat template, system, raw, Go template, context), format, tools, thinking,
model names, metadata routes and Ollama-shaped errors. Bodies are checked with the ``ollama``
client's own response types."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FAKE_TEXT, FakeAsyncLLM  # noqa: E402
from scripted_engine import ScriptedAsyncLLM  # noqa: E402
from api_helpers import make_args  # noqa: E402

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.serving_ollama import render_go_template  # noqa: E402

ollama = pytest.importorskip("ollama")

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 256
USER = [{"role": "user", "content": "Say something."}]
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "entrypoints", "openai",
                        "chat_templates", "tool_chat_template_smollm2_hermes.jinja")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT_TEXT = "<think>\nThe user wants a number.\n</think>\n\nIt is 42."


@pytest.fixture(scope="module")
def engine():
    return FakeAsyncLLM(max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, make_args())) as c:
        yield c


def fake_words(n: int) -> str:
    """The fake engine's first ``n`` generated tokens, as text."""
    from fake_engine import load_tokenizer
    tok = load_tokenizer()
    return tok.decode(tok.encode(FAKE_TEXT, add_special_tokens=False)[:n])


def ndjson(r) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert r.text.endswith("\n")
    return [json.loads(line) for line in r.text.splitlines()]


def assert_ollama_error(r, status: int, contains: str = "") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert contains in body["error"], body
    return body["error"]


STAT_KEYS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
             "eval_count", "eval_duration")


def test_options_map_to_sampling_params(client, engine):
    opts = {"temperature": 0.3, "top_p": 0.8, "top_k": 17, "min_p": 0.05, "seed": 1234,
            "num_predict": 7, "stop": ["zzz", "yyy"], "repeat_penalty": 1.3, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "num_ctx": 4096, "mirostat": 0}  # the last two: ignored
    r = client.post("/api/chat", json={"model": MODEL, "messages": USER, "stream": False, "options": opts,
                                       "keep_alive": "5m"})
    assert r.status_code == 200, r.text
    resp = ollama.ChatResponse.model_validate(r.json())
    sp = engine.received[-1][1]
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.3, 0.8, 17, 0.05, 1234)
    assert sp.max_tokens == 7 and sp.stop == ["zzz", "yyy"]
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.3, 0.5, 0.25)
    assert sp.structured_outputs is None
    assert resp.done is True and resp.done_reason == "length" and resp.eval_count == 7
    assert resp.message.role == "assistant" and resp.message.content == fake_words(7)
    prompt_ids = engine.received[-1][0]["prompt_token_ids"]
    assert resp.prompt_eval_count == len(prompt_ids)
    assert resp.model == MODEL and resp.created_at.endswith("Z")
    body = r.json()
    for k in STAT_KEYS:
        assert isinstance(body[k], int) and body[k] >= 0, (k, body)
    assert body["eval_duration"] >= 1 and body["total_duration"] >= body["prompt_eval_duration"]


def test_num_predict_unlimited_is_the_context(client, engine):
    for n in (-1, -2, 0, None, 100_000):  # 0 too: Ollama's runner limits only a positive num_predict
        opts = {} if n is None else {"num_predict": n}
        r = client.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False, "options": opts})
        assert r.status_code == 200, r.text
        prompt_len = len(engine.received[-1][0]["prompt_token_ids"])
        assert engine.received[-1][1].max_tokens == MAX_LEN - prompt_len, n
        assert r.json()["eval_count"] == MAX_LEN - prompt_len and r.json()["done_reason"] == "length"
    for bad in (-3, -100):
        r = client.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "options": {"num_predict": bad}})
        assert_ollama_error(r, 400, "num_predict")


def test_chat_stream_ndjson(client, engine):
    r = client.post("/api/chat", json={"model": MODEL, "messages": USER, "options": {"num_predict": 5}})
    lines = ndjson(r)
    parts = [ollama.ChatResponse.model_validate(x) for x in lines]
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) == 6  # one token per step, then the final object
    assert "".join(p.message.content for p in parts) == fake_words(5)
    final = lines[-1]
    assert final["message"] == {"role": "assistant", "content": ""}
    assert final["done_reason"] == "length" and final["eval_count"] == 5
    assert final["prompt_eval_count"] == len(engine.received[-1][0]["prompt_token_ids"])
    assert all(k in final for k in STAT_KEYS)
    assert all(set(x) == {"model", "created_at", "message", "done"} for x in lines[:-1])
    assert engine.received[-1][1].output_kind.name == "DELTA"


def test_generate_prompts(client, engine):
    tok = engine.tokenizer
    # chat template with a system prompt
    r = client.post("/api/generate", json={"model": MODEL, "prompt": "Capital of France?", "system": "Be brief.",
                                           "stream": False, "options": {"num_predict": 3}})
    resp = ollama.GenerateResponse.model_validate(r.json())
    prompt = engine.received[-1][0]["prompt"]
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?"
                      "<|im_end|>\n<|im_start|>assistant\n")
    ids = engine.received[-1][0]["prompt_token_ids"]
    assert resp.response == fake_words(3) and resp.done_reason == "length"
    assert list(resp.context) == ids + tok.encode(fake_words(3), add_special_tokens=False)
    # context: the previous conversation's tokens come first
    r = client.post("/api/generate", json={"model": MODEL, "prompt": "And Spain?", "context": resp.context,
                                           "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    ids2 = engine.received[-1][0]["prompt_token_ids"]
    assert ids2[:len(resp.context)] == list(resp.context) and len(ids2) > len(resp.context)
    # raw: the prompt as is, no context returned
    r = client.post("/api/generate", json={"model": MODEL, "prompt": "[INST] hi [/INST]", "raw": True,
                                           "stream": False, "options": {"num_predict": 2}})
    assert engine.received[-1][0]["prompt"] == "[INST] hi [/INST]" and "context" not in r.json()
    assert engine.received[-1][0]["prompt_token_ids"] == tok.encode("[INST] hi [/INST]")
    # an Ollama (Go) template
    tmpl = "{{ if .System }}SYS: {{ .System }}\n{{ end }}USER: {{ .Prompt }}\nASSISTANT: {{ .Response }}</s>"
    r = client.post("/api/generate", json={"model": MODEL, "prompt": "hi", "template": tmpl, "stream": False,
                                           "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    assert engine.received[-1][0]["prompt"] == "USER: hi\nASSISTANT: "
    r = client.post("/api/generate", json={"model": MODEL, "prompt": "hi", "system": "S", "template": tmpl,
                                           "stream": False, "options": {"num_predict": 2}})
    assert engine.received[-1][0]["prompt"] == "SYS: S\nUSER: hi\nASSISTANT: "
    # streamed generate: response pieces, final with context
    lines = ndjson(client.post("/api/generate", json={"model": MODEL, "prompt": "hi", "options": {"num_predict": 4}}))
    assert "".join(x["response"] for x in lines) == fake_words(4)
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4 and "context" in lines[-1]


def test_go_template_subset():
    t = "{{- if .System }}<s>{{ .System }}</s>{{ else }}<none>{{ end -}}\n  [{{ .Prompt }}]{{ .Response }}tail"
    assert render_go_template(t, "", "p") == "<none>[p]"
    assert render_go_template(t, "sys", "p") == "<s>sys</s>[p]"
    from pagedllm.engine.input_processor import InputValidationError
    for bad in ("{{ range .Messages }}x{{ end }}", "{{ if .System }}x", "{{ .Tools }}"):
        with pytest.raises(InputValidationError, match="template"):
            render_go_template(bad, "s", "p")


def test_generate_errors(client):
    assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "x", "images": ["aGk="]}),
                        400, "images")
    # a text-only model refuses images before decoding them: a real PNG and junk get the same answer
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buf, format="PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    for imgs in ([png], ["aGk="], [png, "%%%not base64"]):
        msg = assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "x", "images": imgs}),
                                  400, "images: this model does not take images")
        assert "text-only" in msg
    msg = assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x", "images": [png]}]}), 400, "messages[0].images: this model does not take")
    assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "x", "suffix": "y"}),
                        400, "suffix")
    assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "x",
                                                           "template": "{{ range .Messages }}{{ end }}"}),
                        400, "template")
    assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "x", "context": [10**9]}),
                        400, "context")
    # over the context: cut as Ollama cuts (below); with truncate false, the 400
    assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "word " * 400,
                                                           "truncate": False}), 400, "maximum context length")
    assert_ollama_error(client.post("/api/generate", content=b"{not json"), 400, "invalid JSON")
    assert_ollama_error(client.post("/api/generate", json=[1, 2]), 400, "JSON object")
    assert_ollama_error(client.post("/api/generate", json={"prompt": "x"}), 400, "model")


def test_format_json_and_schema(client, engine):
    r = client.post("/api/chat", json={"model": MODEL, "messages": USER, "format": "json", "stream": False,
                                       "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    so = engine.received[-1][1].structured_outputs
    assert so is not None and so.json_object is True and so.json is None
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    r = client.post("/api/generate", json={"model": MODEL, "prompt": "x", "format": schema, "stream": False,
                                           "options": {"num_predict": 2}})
    assert r.status_code == 200, r.text
    so = engine.received[-1][1].structured_outputs
    assert so.json == schema and not so.json_object
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": USER, "format": "xml"}),
                        400, "format")
    # format "" asks for nothing
    client.post("/api/chat", json={"model": MODEL, "messages": USER, "format": "", "stream": False,
                                   "options": {"num_predict": 1}})
    assert engine.received[-1][1].structured_outputs is None


def test_model_names_and_errors(client):
    r = client.post("/api/chat", json={"model": MODEL + ":latest", "messages": USER, "stream": False,
                                       "options": {"num_predict": 1}})
    assert r.status_code == 200 and r.json()["model"] == MODEL + ":latest"
    msg = assert_ollama_error(client.post("/api/chat", json={"model": "llama3.2", "messages": USER}), 404,
                              "model 'llama3.2' not found")
    assert MODEL + ":latest" in msg
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL + ":7b", "messages": USER}), 404)
    assert_ollama_error(client.post("/api/show", json={"model": "other"}), 404, "not found")
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": USER,
                                                       "options": {"temperature": "hot"}}), 400, "temperature")
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x", "images": ["aGk="]}]}), 400, "images")
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": [
        {"role": "robot", "content": "x"}]}), 400, "role")
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": USER, "think": "max"}),
                        400, "think")
    # no reasoning parser: the model has no "thinking" capability, as Ollama says for such a model
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": USER, "think": True}),
                        400, "does not support thinking")
    assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "x", "think": True}),
                        400, "does not support thinking")
    assert client.post("/api/chat", json={"model": MODEL, "messages": USER, "think": False,
                                          "stream": False}).status_code == 200
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": USER, "tools": [WEATHER_TOOL]}),
                        400, "--enable-auto-tool-choice")
    assert_ollama_error(client.get("/api/nothing"), 404, "404")
    assert_ollama_error(client.post("/api/copy", json={"source": MODEL, "destination": "x"}), 501, "not supported")
    assert_ollama_error(client.request("DELETE", "/api/delete", json={"model": MODEL}), 501)
    assert_ollama_error(client.post("/api/pull", json={"model": "llama3.2"}), 404, "llama3.2")
    r = client.post("/api/pull", json={"model": MODEL, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}


def test_load_and_unload_answers(client, engine):
    n = len(engine.received)
    r = client.post("/api/chat", json={"model": MODEL, "messages": []})
    assert r.json()["done"] is True and r.json()["done_reason"] == "load" and r.json()["message"]["content"] == ""
    r = client.post("/api/generate", json={"model": MODEL, "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and r.json()["response"] == ""
    r = client.post("/api/generate", json={"model": MODEL, "keep_alive": "0s"})
    assert r.json()["done_reason"] == "unload"
    assert len(engine.received) == n  # nothing was generated


def test_metadata_routes(client):
    tags = ollama.ListResponse.model_validate(client.get("/api/tags").json())
    (m,) = tags.models
    assert m.model == MODEL + ":latest"
    assert m.details.format == "gguf" and m.details.family == "llama"
    assert m.details.quantization_level == "Q4_1" and m.details.parameter_size == "135M"
    assert m.size > 50_000_000 and len(m.digest) == 64
    show = ollama.ShowResponse.model_validate(client.post("/api/show", json={"model": MODEL}).json())
    assert show.capabilities == ["completion"]
    assert "<|im_start|>" in show.template and "FROM SmolLM2-135M-Instruct" in show.modelfile
    assert show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.context_length"] == MAX_LEN
    assert show.modelinfo["general.parameter_count"] == 134515008
    assert "num_ctx" in show.parameters and str(MAX_LEN) in show.parameters
    # the older request field `name`
    assert client.post("/api/show", json={"name": MODEL + ":latest"}).status_code == 200
    ps = ollama.ProcessResponse.model_validate(client.get("/api/ps").json())
    (p,) = ps.models
    assert p.model == MODEL + ":latest" and p.context_length == MAX_LEN and p.expires_at.year == 2099
    assert client.get("/api/version").json() == {"version": "0.9.0"}
    assert client.head("/").status_code == 200 and client.head("/api/version").status_code == 200
    assert client.get("/").text == "Ollama is running"
    page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.headers["content-type"].startswith("text/html") and "<title>pagedllm chat</title>" in page.text
    assert client.get("/ui/chat.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/chat.css").status_code == 200
    assert client.get("/ui/..%2Fapi_server.py").status_code == 404


def test_embed_on_a_generation_model(client):
    want = client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}).json()["error"]["message"]
    assert assert_ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "x"}), 400) == want
    assert assert_ollama_error(client.post("/api/embeddings", json={"model": MODEL + ":latest", "prompt": "x"}),
                               400) == want
    assert_ollama_error(client.post("/api/embed", json={"model": "nope", "input": "x"}), 404)


def test_api_key_protects_the_ollama_routes(engine):
    with TestClient(build_app(engine, make_args(api_key="sekret"))) as c:
        assert_ollama_error(c.post("/api/chat", json={"model": MODEL, "messages": USER}), 401, "API key")
        assert_ollama_error(c.get("/api/tags"), 401)
        assert c.get("/api/version").status_code == 200  # the probe stays open
        assert c.get("/api/tags", headers={"Authorization": "Bearer sekret"}).status_code == 200


# ---- tools and thinking, on the scripted engine (the model's text is given) ------------------
class Box:
    script = CALL_TEXT


BOX = Box()


@pytest.fixture(scope="module")
def scripted():
    return ScriptedAsyncLLM(lambda prompt: BOX.script, max_model_len=1024)


def test_tool_calls_and_history(scripted):
    args = make_args(chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with TestClient(build_app(scripted, args)) as c:
        BOX.script = CALL_TEXT
        r = c.post("/api/chat", json={"model": MODEL, "messages": USER, "tools": [WEATHER_TOOL], "stream": False})
        resp = ollama.ChatResponse.model_validate(r.json())
        assert resp.message.content == "Checking."
        (call,) = resp.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
        assert resp.done_reason == "stop"
        prompt = scripted.received[-1][0]["prompt"]
        assert '"name": "get_weather"' in prompt  # the tools reached the template
        # streamed: text pieces, then the complete call in one line, then the final line
        lines = ndjson(c.post("/api/chat", json={"model": MODEL, "messages": USER, "tools": [WEATHER_TOOL]}))
        with_calls = [x for x in lines if x["message"].get("tool_calls")]
        assert len(with_calls) == 1 and with_calls[0]["done"] is False
        assert with_calls[0]["message"]["tool_calls"][0]["function"] == {
            "index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
        assert "".join(x["message"]["content"] for x in lines).strip() == "Checking."
        # the call and its result go back into the conversation (object arguments, tool_name)
        BOX.script = "It is sunny."
        history = USER + [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
        r = c.post("/api/chat", json={"model": MODEL, "messages": history, "tools": [WEATHER_TOOL],
                                      "stream": False})
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"] == "It is sunny." and "tool_calls" not in r.json()["message"]
        prompt = scripted.received[-1][0]["prompt"]
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
        assert "sunny, 21 C" in prompt


def test_thinking(scripted):
    args = make_args(reasoning_parser="deepseek_r1")
    with TestClient(build_app(scripted, args)) as c:
        BOX.script = THOUGHT_TEXT
        r = c.post("/api/chat", json={"model": MODEL, "messages": USER, "think": True, "stream": False})
        resp = ollama.ChatResponse.model_validate(r.json())
        assert resp.message.thinking.strip() == "The user wants a number."
        assert resp.message.content.strip() == "It is 42."
        lines = ndjson(c.post("/api/generate", json={"model": MODEL, "prompt": "n?", "think": True}))
        assert "".join(x.get("thinking", "") for x in lines).strip() == "The user wants a number."
        assert "".join(x["response"] for x in lines).strip() == "It is 42."
        # think false: the reasoning is kept out of the answer and not reported
        r = c.post("/api/chat", json={"model": MODEL, "messages": USER, "think": False, "stream": False})
        assert "thinking" not in r.json()["message"] and r.json()["message"]["content"].strip() == "It is 42."
        show = c.post("/api/show", json={"model": MODEL}).json()
        assert show["capabilities"] == ["completion", "thinking"]


def test_official_client_over_asgi(engine):
    """The ``ollama`` AsyncClient itself (its request building and response parsing)."""
    import httpx

    app = build_app(engine, make_args())

    async def main():
        client = ollama.AsyncClient(host="http://test", transport=httpx.ASGITransport(app=app))
        r = await client.chat(model=MODEL, messages=USER, options={"num_predict": 4})
        assert r.message.content == fake_words(4) and r.eval_count == 4 and r.done_reason == "length"
        parts = [p async for p in await client.chat(model=MODEL, messages=USER, stream=True,
                                                     options={"num_predict": 3})]
        assert "".join(p.message.content for p in parts) == fake_words(3) and parts[-1].done
        g = await client.generate(model=MODEL, prompt="hi", options={"num_predict": 2})
        assert g.response == fake_words(2)
        assert (await client.list()).models[0].model == MODEL + ":latest"
        with pytest.raises(ollama.ResponseError) as e:
            await client.chat(model="missing", messages=USER)
        assert e.value.status_code == 404 and "missing" in e.value.error
        with pytest.raises(ollama.ResponseError) as e:
            await client.embed(model=MODEL, input="x")
        assert e.value.status_code == 400 and "pooling" in e.value.error

    asyncio.run(main())


def test_unclosed_template_action_and_bad_keep_alive(client, engine):
    """A template whose action never closes is a 400 (Go's "unclosed action"), not the literal
    text sent to the model; keep_alive takes seconds or Go durations and refuses anything else."""
    for t in ("{{ .Prompt ", "<s>{{ .System }}</s>{{ .Prompt"):
        assert_ollama_error(client.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "template": t}),
                            400, "template: unclosed action")
    for ka in ("5m", "1h30m", -1, "-1", 0, "0", 300, "1.5h"):
        r = client.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False, "keep_alive": ka,
                                               "options": {"num_predict": 1}})
        assert r.status_code == 200, (ka, r.text)
    for ka in ("bogus", "5 minutes", ""):
        for route, body in (("/api/generate", {"prompt": "Hi"}), ("/api/chat", {"messages": USER})):
            assert_ollama_error(client.post(route, json={"model": MODEL, "keep_alive": ka, **body}), 400, "keep_alive")


def test_chat_final_assistant_message_is_a_prefill(client, engine):
    """A last assistant message with text is continued: the prompt ends inside that turn."""
    r = client.post("/api/chat", json={"model": MODEL, "stream": False, "options": {"num_predict": 2}, "messages": [
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}]})
    assert r.status_code == 200, r.text
    prompt = engine.received[-1][0]["prompt"]
    assert prompt.rstrip().endswith("The capital is"), prompt[-60:]
    r = client.post("/api/chat", json={"model": MODEL, "stream": False, "options": {"num_predict": 2},
                                       "messages": USER})
    assert not engine.received[-1][0]["prompt"].rstrip().endswith(USER[-1]["content"])


def test_prompt_over_the_context_is_truncated_as_ollama(client, engine):
    """/api/generate: the first num_keep tokens (default 4) and the latest ones, max_model_len - 1
    in all. /api/chat: older turns are dropped (system kept, the last message kept)."""
    words = " ".join(f"w{i}" for i in range(600))
    r = client.post("/api/generate", json={"model": MODEL, "prompt": words, "raw": True, "stream": False,
                                           "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    full = engine.tokenizer.encode(words, add_special_tokens=True)
    got = engine.received[-1][0]["prompt_token_ids"]
    assert len(got) == MAX_LEN - 1 and got[:4] == full[:4] and got[4:] == full[-(MAX_LEN - 5):]
    assert r.json()["prompt_eval_count"] == MAX_LEN - 1
    r = client.post("/api/generate", json={"model": MODEL, "prompt": words, "raw": True, "stream": False,
                                           "options": {"num_predict": 1, "num_keep": 10}})
    got = engine.received[-1][0]["prompt_token_ids"]
    assert got[:10] == full[:10] and got[10:] == full[-(MAX_LEN - 11):]
    # chat: 12 turns of ~40 tokens each do not fit 256; the system message and the latest turns do
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"question {i} " + "x " * 30},
                  {"role": "assistant", "content": f"answer {i} " + "y " * 30}]
    msgs = [{"role": "system", "content": "SYSTEM-RULES"}] + turns + [{"role": "user", "content": "LAST-QUESTION"}]
    r = client.post("/api/chat", json={"model": MODEL, "messages": msgs, "stream": False,
                                       "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    prompt = engine.received[-1][0]["prompt"]
    ids = engine.received[-1][0]["prompt_token_ids"]
    assert len(ids) <= MAX_LEN - 1
    assert "SYSTEM-RULES" in prompt and "LAST-QUESTION" in prompt and "answer 11" in prompt
    assert "question 0 " not in prompt
    kept = [i for i in range(12) if f"question {i} " in prompt]
    assert kept and kept == list(range(kept[0], 12))  # a run of the latest turns
    assert_ollama_error(client.post("/api/chat", json={"model": MODEL, "messages": msgs, "truncate": False}),
                        400, "maximum context length")
