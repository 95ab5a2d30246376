"""Images through a real ``pagedllm serve`` of the tiny random Gemma 3 image-text checkpoint (a
subprocess): the openai, anthropic and ollama clients send one image each (as the OpenAI
``image_url`` data URL, an Anthropic base64 ``image`` block, an Ollama ``images`` entry) and get the
same greedy answer the offline engine gives; ``file://`` under ``--allowed-local-media-path``;
malformed inputs are 400s naming the field; the encoder cache shows in /metrics."""
from __future__ import annotations

import base64
import sys

import httpx
import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mm_helpers import image, make_gemma3_mm_checkpoint, png_bytes  # noqa: E402
from server_helpers import serve  # noqa: E402

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

N = 6
IMG = image(7)
B64 = base64.b64encode(png_bytes(IMG)).decode()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("mmserve")
    ckpt = str(d / "ckpt")
    make_gemma3_mm_checkpoint(ckpt)
    media = d / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png_bytes(IMG))
    with serve([ckpt, "--dtype", "float32", "--max-model-len", "64", "--served-model-name", "tiny", "--block-size", "4",
                "--limit-mm-per-prompt", '{"image": 1}', "--allowed-local-media-path", str(media),
                "--disable-log-stats"]) as (base, _):
        yield base, str(media / "a.png")


def _chat_body(content, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": N,
            "temperature": 0, **kw}


def _image_url(url):
    return [{"type": "text", "text": "w40 w41"}, {"type": "image_url", "image_url": {"url": url}}]


def test_openai_client_image(setup):
    base, path = setup
    c = openai.OpenAI(base_url=base + "/v1", api_key="x")
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": _image_url(
        "data:image/png;base64," + B64)}], max_tokens=N, temperature=0)
    assert r.usage.completion_tokens == N or r.choices[0].finish_reason == "stop"
    text = r.choices[0].message.content
    # the same image from a file:// URL: the same answer, served from the prefix cache
    r2 = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": _image_url(
        "file://" + path)}], max_tokens=N, temperature=0)
    assert r2.choices[0].message.content == text
    assert r2.usage.prompt_tokens_details is None or r2.usage.prompt_tokens_details.cached_tokens > 0


def test_anthropic_and_ollama_clients(setup):
    base, _ = setup
    c = anthropic.Anthropic(base_url=base, api_key="x")
    m = c.messages.create(model="tiny", max_tokens=N, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
        {"type": "text", "text": "w40 w41"}]}])
    assert m.content and m.usage.output_tokens >= 1
    oc = ollama.Client(host=base, timeout=120)
    r = oc.chat(model="tiny", messages=[{"role": "user", "content": "w40 w41", "images": [B64]}],
                options={"temperature": 0, "num_predict": N})
    assert r.message.role == "assistant" and r.eval_count >= 1
    # Anthropic puts the image first like Ollama: the same prompt, the same greedy text
    assert r.message.content == "".join(b.text for b in m.content if b.type == "text")
    g = oc.generate(model="tiny", prompt="w40 w41", images=[B64], options={"temperature": 0, "num_predict": N})
    assert g.response == r.message.content


@pytest.mark.parametrize("content,param", [
    (_image_url("data:image/png;base64,bm90IGFuIGltYWdl"), "messages[0].content[1]"),  # undecodable
    (_image_url("http://127.0.0.1:1/x.png"), "messages[0].content[1]"),  # remote media off
    (_image_url("file:///etc/hostname"), "messages[0].content[1]"),  # outside the allowed directory
    (_image_url("data:image/png;base64," + B64) + _image_url("data:image/png;base64," + B64)[1:],
     "multi_modal_data"),  # two images, the limit is one
])
def test_bad_images_are_400(setup, content, param):
    base, _ = setup
    r = httpx.post(base + "/v1/chat/completions", json=_chat_body(content), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_bad_ollama_and_anthropic_images(setup):
    base, _ = setup
    r = httpx.post(base + "/api/chat", json={"model": "tiny", "stream": False, "messages": [
        {"role": "user", "content": "w5", "images": ["%%%"]}]}, timeout=60)
    assert r.status_code == 400 and "base64" in r.text
    r = httpx.post(base + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]}, timeout=60)
    assert r.status_code == 400
    # the server still answers
    ok = httpx.post(base + "/v1/chat/completions", json=_chat_body("w5 w6"), timeout=60)
    assert ok.status_code == 200


def test_metrics_show_encoder_cache(setup):
    base, _ = setup
    text = httpx.get(base + "/metrics", timeout=30).text
    lines = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
             if ln.startswith("pagedllm:encoder_cache")}
    assert lines["pagedllm:encoder_cache_capacity_tokens"] == 8192
    assert 0 < lines["pagedllm:encoder_cache_usage_tokens"] <= 8192
    assert lines["pagedllm:encoder_cache_queries_total"] >= 3
    assert lines["pagedllm:encoder_cache_hits_total"] >= 1


def test_readme_image_example(setup, tmp_path):
    """examples/openai_image_chat.py (the README's image block) against this server: it prints the
    answer the openai client gets for the same image and question."""
    import os
    import subprocess

    base, path = setup
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PAGEDLLM_URL=base, PAGEDLLM_MODEL="tiny")
    p = subprocess.run([sys.executable, os.path.join(root, "examples", "openai_image_chat.py"), path], env=env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    c = openai.OpenAI(base_url=base + "/v1", api_key="x")
    r = c.chat.completions.create(model="tiny", max_tokens=16, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + B64}},
        {"type": "text", "text": "What is in this picture?"}]}])
    assert p.stdout.rstrip("\n") == r.choices[0].message.content
