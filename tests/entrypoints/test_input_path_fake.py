"""One input path for HTTP and offline (issue 16 part 3), against the fake engine.

The server checks, tokenizes and renders through the engine's ``InputProcessor`` and
``pagedllm.engine.chat`` (what ``LLM`` uses), so the same input gives the same token ids or the
same error message both ways; it holds a typed ``EngineClient`` and never probes it with
``getattr``. ``offline`` below is the InputProcessor ``LLMEngine`` builds (same class, same
arguments); ``test_input_path_real.py`` compares the real ``LLM`` with the real server.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import sys

import pytest
from fastapi.testclient import TestClient

from pagedllm.engine.chat import apply_chat_template
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeAsyncLLM  # noqa: E402
from api_helpers import make_args  # noqa: E402

MML = 64
LONG = "hello " * 100  # > MML tokens


@pytest.fixture(scope="module")
def engine():
    return FakeAsyncLLM(max_model_len=MML)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, make_args())) as c:
        yield c


@pytest.fixture(scope="module")
def offline(engine):
    """The offline front end's InputProcessor (as LLMEngine builds it: max_logprobs 20)."""
    return InputProcessor(engine.tokenizer, MML, engine.vocab_size, 20, eos_token_id=engine.tokenizer.eos_token_id)


def _error(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def _offline_error(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


# ------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize("body,prompt,kw,param", [
    ({"prompt": ""}, "", {}, "prompt"),
    ({"prompt": [1, 10**6]}, {"prompt_token_ids": [1, 10**6]}, {}, "prompt"),
    ({"prompt": LONG}, LONG, {}, "prompt"),
    ({"prompt": "\ud800"}, "\ud800", {}, "prompt"),  # a lone surrogate: valid JSON, not UTF-8
    ({"prompt": "hi", "logprobs": 21}, "hi", {"logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "hi", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "truncate_prompt_tokens": MML + 1}, "hi", {"truncate_prompt_tokens": MML + 1},
     "truncate_prompt_tokens"),
])
def test_same_error_offline_and_served(client, offline, body, prompt, kw, param):
    """Each check runs once, in the InputProcessor: the server's 400 carries the message the
    offline ValueError has (before: "Token id 1000000 is out of vocabulary (vocab size 49152)."
    vs "prompt_token_ids: token id 1000000 is out of vocabulary (valid ids are 0..49151)", a
    TypeError offline for the surrogate, truncation past max_model_len accepted offline, ...)."""
    # NOTE: ASCII JSON: a lone surrogate is a valid \ud800 escape, not encodable UTF-8
    served = _error(client.post("/v1/completions", content=json.dumps({"max_tokens": 4, **body}),
                                headers={"content-type": "application/json"}), param)
    off = _offline_error(lambda: offline.process_inputs("x", prompt, SamplingParams(max_tokens=4, **kw)))
    assert served == off
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_truncate_zero_is_the_same_error(client):
    """truncate_prompt_tokens=0: the server emptied the prompt ("The prompt cannot be empty."),
    offline SamplingParams refused it; now both give SamplingParams' message."""
    served = _error(client.post("/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": 0}),
                    "truncate_prompt_tokens")
    assert served == _offline_error(lambda: SamplingParams(truncate_prompt_tokens=0))


def test_server_length_rule_is_the_async_engines(client, offline):
    """prompt + max_tokens over max_model_len: one message (strict_length, what AsyncLLM applies to
    raw prompts too), under each endpoint's name for the field."""
    off = _offline_error(lambda: offline.process_inputs("x", "hi", SamplingParams(max_tokens=MML),
                                                        strict_length=True))
    assert "maximum context length is 64 tokens" in off
    assert _error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": MML}), "max_tokens") == off
    msgs = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": MML})
    assert "maximum context length is 64 tokens" in _error(r, "max_completion_tokens")
    _error(client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": MML}), "max_tokens")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": LONG}]}),
           "messages")
    _error(client.post("/v1/chat/completions", json={"messages": msgs, "logprobs": True, "top_logprobs": 21}),
           "top_logprobs")
    _error(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": MML}), "max_output_tokens")
    _error(client.post("/v1/responses", json={"input": LONG}), "input")


def test_truncated_prompt_text_is_what_the_model_sees(client, engine, offline):
    """With truncation, the prompt text (echo, RequestOutput.prompt) is the text of the kept ids
    on both paths (offline kept the whole input text before)."""
    text = "one two three four five six seven eight"
    ids = engine.tokenizer.encode(text)[-3:]
    req = offline.process_inputs("x", text, SamplingParams(max_tokens=1, truncate_prompt_tokens=3))
    assert req.prompt_token_ids == ids and req.prompt == engine.tokenizer.decode(ids) != text
    r = client.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 3, "max_tokens": 1,
                                             "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(req.prompt)
    assert engine.received[-1][0] == {"prompt_token_ids": ids, "prompt": req.prompt, "cache_salt": None}


# ------------------------------------------------------------------------------------ chat
TOOL_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
                 "<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def _served_ids(client, messages, **extra):
    r = client.post("/tokenize", json={"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _offline_ids(engine, messages, **kw):
    """What LLM.chat tokenizes for ``messages``."""
    text = apply_chat_template(engine.tokenizer, messages, **kw)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_chat_with_tool_history_same_ids(client, engine):
    """Assistant tool-call arguments reach the template as objects on both paths (offline passed
    the JSON text, which ``tojson`` quoted: other tokens than the server's)."""
    served = _served_ids(client, TOOL_CONV, chat_template=TOOL_TEMPLATE)
    assert _offline_ids(engine, TOOL_CONV, chat_template=TOOL_TEMPLATE) == served
    assert '<call>get_weather {"city": "Paris"}</call>' in engine.tokenizer.decode(served)
    assert TOOL_CONV[1]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Paris\"}"  # not mutated


def test_chat_template_kwargs_and_content_parts_same_ids(client, engine):
    """``chat_template_kwargs`` override the flags (a TypeError offline before) and Responses-style
    ``input_text`` parts are text (refused offline before)."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kw = {"add_generation_prompt": False}
    served = _served_ids(client, msgs, chat_template_kwargs=kw)
    assert _offline_ids(engine, msgs, chat_template_kwargs=kw) == served
    assert served != _served_ids(client, msgs)
    parts = [msgs[0], {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    assert _offline_ids(engine, parts) == _served_ids(client, parts) == _served_ids(client, msgs)


def test_chat_render_errors_same(client, engine):
    """A template that fails, and continue_final_message without a final assistant message:
    the server's 400 message is the offline ValueError's."""
    msgs = [{"role": "user", "content": "Hi"}]
    bad = "{{ raise_exception('no chat for you') }}"
    r = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": bad})
    served = _error(r, "messages")
    assert "no chat for you" in served
    assert served == _offline_error(lambda: apply_chat_template(engine.tokenizer, msgs, chat_template=bad))
    r = client.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True,
                                                  "add_generation_prompt": False})
    assert _error(r, "messages") == _offline_error(lambda: apply_chat_template(
        engine.tokenizer, msgs, add_generation_prompt=False, continue_final_message=True))


def test_one_chat_template_loader(engine, tmp_path):
    """``--chat-template`` (server) and ``EngineArgs.chat_template`` (LLM) load with one function:
    "chatml" (no file, no Jinja) was a literal template for LLM and an error for the server."""
    import pagedllm.engine.llm_engine as llm_engine
    from pagedllm.engine.chat import load_chat_template

    assert llm_engine.load_chat_template is load_chat_template
    path = tmp_path / "t.jinja"
    path.write_text(TOOL_TEMPLATE)
    assert load_chat_template(str(path)) == load_chat_template(TOOL_TEMPLATE) == TOOL_TEMPLATE
    offline = _offline_error(lambda: load_chat_template("chatml"))
    assert offline == _offline_error(lambda: build_app(engine, make_args(chat_template="chatml")))
    assert "chatml" in offline


# ------------------------------------------------------------------------------------ EngineClient
def test_engine_clients_implement_the_protocol(engine):
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.dp_async_llm import DPAsyncLLM
    from pagedllm.engine.protocol import EngineClient, missing_members

    assert isinstance(engine, EngineClient) and missing_members(engine) == []
    kinds = {"generate": inspect.isasyncgenfunction, "encode": inspect.iscoroutinefunction,
             "abort": inspect.iscoroutinefunction, "reset_prefix_cache": inspect.iscoroutinefunction,
             "check_health": inspect.iscoroutinefunction, "add_lora": inspect.iscoroutinefunction,
             "remove_lora": inspect.iscoroutinefunction, "list_loras": inspect.iscoroutinefunction}
    methods = [n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")]
    assert set(kinds) < set(methods)
    for cls in (AsyncLLM, DPAsyncLLM, FakeAsyncLLM):
        for name in methods:
            fn = getattr(cls, name)
            assert kinds.get(name, lambda f: not inspect.iscoroutinefunction(f))(fn), (cls, name)


def test_server_does_not_probe_the_engine():
    """No ``getattr(engine, ...)`` / ``hasattr(self.engine, ...)`` in the server: it is typed."""
    import pagedllm.entrypoints.openai as pkg

    found = []
    for f in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                target = ast.unparse(node.args[0])
                if target.split(".")[0] in ("engine", "self") and "engine" in target:
                    found.append(f"{f.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
