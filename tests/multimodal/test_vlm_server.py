"""LLaVA, LLaVA-NeXT, Idefics3 (SmolVLM) and Qwen2.5-VL images through a real ``pagedllm serve`` of their tiny random checkpoints
(tests/multimodal/vlm_helpers.py): the openai client's ``image_url`` data URL gets transformers' greedy
answer for the same chat; an Anthropic base64 ``image`` block and an Ollama ``images`` entry reach the
model (the same prompt, the same answer); malformed images are 400s naming the field."""
from __future__ import annotations

import base64
import sys

import httpx
import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mm_helpers import hf_greedy_mm, image, png_bytes  # noqa: E402
from qwenvl_helpers import make_qwen2_5_vl_checkpoint  # noqa: E402
from server_helpers import serve  # noqa: E402
from vlm_helpers import make_idefics3_checkpoint, make_llava_checkpoint, make_llava_next_checkpoint  # noqa: E402

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

N = 6
IMG = image(7)
B64 = base64.b64encode(png_bytes(IMG)).decode()
MAKERS = {"llava": make_llava_checkpoint, "idefics3": make_idefics3_checkpoint,
          "qwen2_5_vl": make_qwen2_5_vl_checkpoint, "llava_next": make_llava_next_checkpoint}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def setup(request, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp(request.param))
    hf, proc = MAKERS[request.param](ckpt)
    with serve([ckpt, "--dtype", "float32", "--max-model-len", "128", "--served-model-name", "tiny",
                "--block-size", "4", "--limit-mm-per-prompt", '{"image": 1}', "--disable-log-stats"]) as (base, _):
        yield base, hf, proc


def _reference(hf, proc, parts):
    """transformers' greedy text for one user turn of ``parts`` (text / image template parts)."""
    text = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    _, toks, _ = hf_greedy_mm(hf, proc, text, [IMG], N)
    return proc.tokenizer.decode(toks, skip_special_tokens=True)


def test_openai_image_url_matches_transformers(setup):
    base, hf, proc = setup
    c = openai.OpenAI(base_url=base + "/v1", api_key="x")
    r = c.chat.completions.create(model="tiny", max_tokens=N, temperature=0, extra_body={"ignore_eos": True},
                                  messages=[{"role": "user", "content": [
                                      {"type": "text", "text": "w40 w41"},
                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64," + B64}}]}])
    assert r.usage.completion_tokens == N
    ref = _reference(hf, proc, [{"type": "text", "text": "w40 w41"}, {"type": "image"}])
    assert r.choices[0].message.content.split() == ref.split()  # word-level pieces: spacing differs
    # the same image again: served from the prefix cache, the same answer
    r2 = c.chat.completions.create(model="tiny", max_tokens=N, temperature=0, extra_body={"ignore_eos": True},
                                   messages=[{"role": "user", "content": [
                                       {"type": "text", "text": "w40 w41"},
                                       {"type": "image_url", "image_url": {"url": "data:image/png;base64," + B64}}]}])
    assert r2.choices[0].message.content == r.choices[0].message.content
    assert r2.usage.prompt_tokens_details is None or r2.usage.prompt_tokens_details.cached_tokens > 0


def test_anthropic_and_ollama_images(setup):
    base, hf, proc = setup
    ref = _reference(hf, proc, [{"type": "image"}, {"type": "text", "text": "w40 w41"}])
    c = anthropic.Anthropic(base_url=base, api_key="x")
    m = c.messages.create(model="tiny", max_tokens=N, extra_body={"temperature": 0, "ignore_eos": True},
                          messages=[{"role": "user", "content": [
                              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
                              {"type": "text", "text": "w40 w41"}]}])
    assert "".join(b.text for b in m.content if b.type == "text").split() == ref.split()
    oc = ollama.Client(host=base, timeout=120)
    r = oc.chat(model="tiny", messages=[{"role": "user", "content": "w40 w41", "images": [B64]}],
                options={"temperature": 0, "num_predict": N})
    assert r.eval_count >= 1
    got = r.message.content.split()
    assert got == ref.split()[:len(got)]  # Ollama may stop at EOS; up to there transformers' words


@pytest.mark.parametrize("body,path,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}], "max_tokens": 2},
     "/v1/chat/completions", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,xx"}}]}],
      "max_tokens": 2}, "/v1/chat/completions", "messages[0].content[0]"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@@"}}]}]},
     "/v1/messages", "messages[0].content[0]"),
    ({"stream": False, "messages": [{"role": "user", "content": "w5", "images": ["bm90IGFuIGltYWdl"]}]},
     "/api/chat", "messages[0].images[0]"),
])
def test_malformed_images_are_400(setup, body, path, param):
    base, _, _ = setup
    r = httpx.post(base + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.text, r.text
    assert httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "w5 w6"}]}, timeout=60).status_code == 200
