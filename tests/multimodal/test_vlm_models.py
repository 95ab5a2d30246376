"""Tiny random LLaVA and Idefics3 (SmolVLM) checkpoints (tests/multimodal/vlm_helpers.py) vs transformers
on the same weights, processor and images: image embeddings, greedy tokens and logprobs through
``LLM`` (prefill chunks that split an image run: both models attend causally), two images in one
prompt, Idefics3's tiles as separate encoder-cache entries, and the image-aware prefix cache."""

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mm_helpers import hf_greedy_mm, image  # noqa: E402
from vlm_helpers import make_idefics3_checkpoint, make_llava_checkpoint  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

N = 6
TEXT = "w5 w7 <image> w9 w20 w31"
MAKERS = {"llava": make_llava_checkpoint, "idefics3": make_idefics3_checkpoint}
_CACHE: dict = {}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def case(request, tmp_path_factory):
    """(name, hf model, processor, LLM) per architecture, built once per module."""
    name = request.param
    if name not in _CACHE:
        _CACHE.clear()  # one LLM alive at a time
        d = str(tmp_path_factory.mktemp(name))
        hf, proc = MAKERS[name](d)
        # block_size 4 and a 8-token budget: image runs (16 LLaVA tokens, 4 per Idefics3 tile) are split
        llm = LLM(d, dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=8,
                  limit_mm_per_prompt={"image": 2}, encoder_cache_size=64)
        _CACHE[name] = (name, hf, proc, llm)
    return _CACHE[name]


def greedy(n=N):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def _run(llm, prompt):
    o = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    lps = [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
    return o, list(o.outputs[0].token_ids), lps


def _model(llm):
    return llm.llm_engine.core.executor.driver_worker.runner.model


def test_image_embeddings_match(case):
    name, hf, proc, llm = case
    out = proc(text=TEXT, images=[image(4)], return_tensors="pt")
    px = out["pixel_values"]
    with torch.no_grad():
        ref = hf.model.get_image_features(px).pooler_output
    ref = torch.cat([r.reshape(-1, r.shape[-1]) for r in ref])
    ours = _model(llm).embed_images(px[0] if px.dim() == 5 else px)
    torch.testing.assert_close(ours.reshape(-1, ours.shape[-1]), ref, atol=1e-5, rtol=1e-4)


def test_generate_matches_transformers(case):
    name, hf, proc, llm = case
    img = image(1)
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, TEXT, [img], N)
    o, toks, lps = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert o.prompt_token_ids == ids
    assert toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)


def test_two_images_and_prefix_cache(case):
    name, hf, proc, llm = case
    text = "w5 <image> w9 <image> w33"
    imgs = [image(2), image(3, size=(20, 50))]
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, text, imgs, N)
    eng = llm.llm_engine.core
    o, toks, lps = _run(llm, {"prompt": text, "multi_modal_data": {"image": imgs}})
    assert o.prompt_token_ids == ids and toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)
    # the same images again: prefix-cache hit, the same tokens
    o2, toks2, _ = _run(llm, {"prompt": text, "multi_modal_data": {"image": imgs}})
    assert toks2 == ref and (o2.num_cached_tokens or 0) >= 4
    # other images in the same places: no stale hit on the image blocks, transformers' answer
    other = [image(5), image(6, size=(20, 50))]
    _, ref3, _ = hf_greedy_mm(hf, proc, text, other, N)
    assert _run(llm, {"prompt": text, "multi_modal_data": {"image": other}})[1] == ref3
    assert eng is llm.llm_engine.core


def test_chat_with_image_part(case):
    name, hf, proc, llm = case
    img = image(8)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}, {"type": "image_pil", "image_pil": img}]}]
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "w40 w41"},
                                                                 {"type": "image"}]}], add_generation_prompt=True)
    _, ref, _ = hf_greedy_mm(hf, proc, text, [img], N)
    o = llm.chat(msgs, greedy(), use_tqdm=False)[0]
    assert list(o.outputs[0].token_ids) == ref


def test_bench_image_runs(tmp_path):
    """``pagedllm bench image`` on the tiny LLaVA: with both caches on the repeated image's blocks hit the
    prefix cache (the encoder runs once per distinct image); with the encoder cache only, lookups hit."""
    import argparse

    from pagedllm.multimodal.bench import add_image_parser, run_image

    _CACHE.clear()
    d = str(tmp_path / "llava")
    make_llava_checkpoint(d)
    sub = argparse.ArgumentParser().add_subparsers(dest="bench_cmd")
    add_image_parser(sub)
    args = sub.choices["image"].parse_args([d, "--dtype", "float32", "--num-prompts", "4", "--num-images", "2",
                                            "--image-size", "28", "--question-len", "4", "--output-len", "2",
                                            "--max-model-len", "64"])
    r = run_image(args)
    assert r["cache_on_sequential_cached_tokens"] >= 2 * 16  # requests 3 and 4 reuse images 1 and 2
    assert r["cache_off_sequential_cached_tokens"] == 0
    assert r["cache_on_encoder_cache_queries"] == 3  # warm-up + 2 distinct images, then prefix hits
    assert r["encoder_cache_only_encoder_cache_hits"] > 0 and r["cache_off_encoder_cache_hits"] == 0


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_load_from_transformers_state_dict(name, tmp_path):
    """transformers' in-memory names (``model.vision_tower.vision_model.*``, ``model.text_model.*``, ...)
    load as well as the saved files' names; image embeddings and logits match."""
    from pagedllm.models.registry import get_model_class

    hf, proc = MAKERS[name](str(tmp_path / name))
    ours = get_model_class([type(hf).__name__])(hf.config, torch.float32)
    ours.load_weights(hf.state_dict().items())
    px = proc(text=TEXT, images=[image(9)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = torch.cat([r.reshape(-1, r.shape[-1]) for r in hf.model.get_image_features(px).pooler_output])
    got = ours.embed_images(px[0] if px.dim() == 5 else px)
    torch.testing.assert_close(got.reshape(-1, got.shape[-1]), ref, atol=1e-5, rtol=1e-4)


def test_llava_config_with_top_level_vocab_size(tmp_path):
    """llava-hf's config.json keeps a top-level ``vocab_size`` beside ``text_config``: still an image-text
    model (the loader takes the text config from ``text_config``), with transformers' greedy tokens."""
    import json

    _CACHE.clear()
    d = str(tmp_path / "llava")
    hf, proc = make_llava_checkpoint(d)
    cfg = json.load(open(d + "/config.json"))
    cfg["vocab_size"] = cfg["text_config"]["vocab_size"]
    json.dump(cfg, open(d + "/config.json", "w"))
    llm = LLM(d, dtype="float32", max_model_len=64, block_size=4)
    img = image(11)
    ids, ref, _ = hf_greedy_mm(hf, proc, TEXT, [img], N)
    o, toks, _ = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert o.prompt_token_ids == ids and toks == ref
