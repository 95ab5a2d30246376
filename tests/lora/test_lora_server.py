"""LoRA through the OpenAI server (a subprocess on the tiny random Llama): adapters listed by
/v1/models with their parent, selected by the `model` field (outputs equal transformers + peft),
loaded and unloaded at run time while other requests stream, vLLM's messages and status codes,
the routes only behind --allow-runtime-lora-updating, and the LoRA metrics."""
from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest
from server_helpers import serve

from lora_helpers import peft_greedy

PROMPT = [1, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 5]
N = 24


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    path, _, adapters = tiny_ckpt
    with serve([path, "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", str(16 * 1024**2),
                "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                "--lora-modules", f"a1={adapters['a1']}",
                json.dumps({"name": "a3", "path": adapters["a3"], "base_model_name": "tiny"}),
                "--allow-runtime-lora-updating", "--disable-log-stats", "--disable-log-requests"],
               env_drop=("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
               stop_timeout=20) as (base, _):
        yield base


@pytest.fixture(scope="module")
def refs(tiny_ckpt):
    _, hf, adapters = tiny_ckpt
    from lora_helpers import word_tokenizer

    tok = word_tokenizer()
    out = {}
    for name in (None, "a1", "a2", "a3"):
        ids, _ = peft_greedy(hf, None if name is None else adapters[name], PROMPT, N)
        out[name] = tok.decode(ids)
    assert len(set(out.values())) == 4
    return out


def _complete(base, model, stream=False):
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(base + "/v1/completions", json=body, timeout=120)


def _text(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_models_lists_adapters_with_parent(server, tiny_ckpt):
    _, _, adapters = tiny_ckpt
    data = httpx.get(server + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) >= {"tiny", "a1", "a3"}
    assert by_id["tiny"]["parent"] is None
    for name in ("a1", "a3"):
        assert by_id[name]["parent"] == "tiny" and by_id[name]["root"] == adapters[name]


def test_model_field_selects_the_adapter(server, refs):
    for model, name in (("tiny", None), ("a1", "a1"), ("a3", "a3")):
        r = _complete(server, model)
        assert _text(r).strip() == refs[name].strip()
        assert r.json()["model"] == model


def test_unknown_model_is_404_naming_it(server):
    r = _complete(server, "no-such-adapter")
    assert r.status_code == 404
    err = r.json()["error"]
    assert "no-such-adapter" in err["message"] and err["type"] == "NotFoundError" and err["code"] == 404


def _stream(base, model, out, key):
    with httpx.stream("POST", base + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        text = []
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text.append(chunk["choices"][0]["text"])
                out.setdefault(key + ":started", True)
        out[key] = "".join(text)


def test_load_and_unload_while_requests_run(server, refs, tiny_ckpt, tmp_path):
    _, _, adapters = tiny_ckpt
    got: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, m, got, f"{m}{i}"))
               for i in range(2) for m in ("tiny", "a1")]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while not any(k.endswith(":started") for k in got) and time.time() < deadline:
        time.sleep(0.01)
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]},
                   timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully.", r.text
    a2 = _complete(server, "a2")
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        assert got[f"tiny{i}"].strip() == refs[None].strip()
        assert got[f"a1{i}"].strip() == refs["a1"].strip()
    assert _text(a2).strip() == refs["a2"].strip()
    assert "a2" in {m["id"] for m in httpx.get(server + "/v1/models").json()["data"]}

    # vLLM's errors: a name in use, missing fields, nothing at the path, a bad adapter
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": adapters["a2"]})
    assert r.status_code == 400 and "is the served model's name" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "lora_name"
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "", "lora_path": adapters["a2"]})
    assert r.status_code == 400 and "Both 'lora_name' and 'lora_path'" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "x")})
    assert r.status_code == 404 and "'gone'" in r.json()["error"]["message"]
    from lora_helpers import make_peft_adapter
    big = make_peft_adapter(tiny_ckpt[1], str(tmp_path / "r16"), r=16, alpha=16)
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": big})
    assert r.status_code == 400 and "'big'" in r.json()["error"]["message"]
    assert "max_lora_rank 8" in r.json()["error"]["message"]
    assert "big" not in {m["id"] for m in httpx.get(server + "/v1/models").json()["data"]}

    # unload while a request on it streams: that request finishes with the adapter
    got2: dict = {}
    t = threading.Thread(target=_stream, args=(server, "a2", got2, "a2"))
    t.start()
    while "a2:started" not in got2 and t.is_alive():
        time.sleep(0.01)
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' removed successfully."
    t.join(timeout=120)
    assert got2["a2"].strip() == refs["a2"].strip()
    r = _complete(server, "a2")
    assert r.status_code == 404 and "`a2`" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'a2' cannot be found."
    # loaded again: a new id, the same outputs
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]})
    assert r.status_code == 200
    assert _text(_complete(server, "a2")).strip() == refs["a2"].strip()


def test_metrics(server):
    _complete(server, "a1")
    text = httpx.get(server + "/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("pagedllm:lora_requests_info{")]
    assert len(lines) == 1, lines
    assert 'max_lora="2"' in lines[0] and 'running_lora_adapters=""' in lines[0]
    cache = [ln for ln in text.splitlines() if ln.startswith("pagedllm:lora_cpu_cache_adapters{")]
    cap = [ln for ln in text.splitlines() if ln.startswith("pagedllm:lora_cpu_cache_capacity{")]
    assert cap and float(cap[0].split()[-1]) == 3.0
    assert cache and 1.0 <= float(cache[0].split()[-1]) <= 3.0
