"""A tiny random Qwen2.5-VL checkpoint (tests/multimodal/qwenvl_helpers.py) vs transformers on the same
weights, processor and images: the vision tower (window attention, 2D rotary, merger) on images of
different sizes, the M-RoPE positions of prompts with images, and greedy tokens and logprobs through
``LLM`` with prefill chunks that split image runs (8-token budget), several images, the image-aware
prefix cache (a hit starts mid-prompt: positions after an image must keep its offset), chat image
parts, text-only prompts, and both checkpoint name layouts."""

import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mm_helpers import hf_greedy_mm, image, greedy_params, run_greedy, runner_model  # noqa: E402
from qwenvl_helpers import make_qwen2_5_vl_checkpoint  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

N = 6
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = f"w5 w7 {IMG} w9 w20 w31"
TWO = f"w5 {IMG} w9 {IMG} w33 w34"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    hf, proc = make_qwen2_5_vl_checkpoint(d)
    return d, hf, proc


@pytest.fixture(scope="module")
def llm(ckpt):
    # block_size 4 and an 8-token budget: image runs (20 and 12 tokens) are split across chunks
    return LLM(ckpt[0], dtype="float32", max_model_len=160, block_size=4, max_num_batched_tokens=8,
               limit_mm_per_prompt={"image": 2}, encoder_cache_size=64)


def greedy(n=N, **kw):
    return greedy_params(n, **kw)


def _run(llm, prompt, **kw):
    return run_greedy(llm, prompt, N, **kw)


def _model(llm):
    return runner_model(llm)


IMAGES = [image(2), image(3, size=(20, 50)), image(4, size=(64, 24))]


def test_vision_tower_matches_transformers(llm, ckpt):
    """Dynamic resolution: three sizes (grids 8x10, 12x4 and 6x16 patches; windows padded on some)."""
    _, hf, proc = ckpt
    ours = _model(llm)
    for img in IMAGES:
        out = proc(text=f"w5 {IMG}", images=[img], return_tensors="pt")
        px, grid = out["pixel_values"], out["image_grid_thw"]
        with torch.no_grad():
            ref = hf.model.get_image_features(px, grid).pooler_output[0]
        got = ours.embed_images(px, tuple(grid[0].tolist()))[0]
        assert got.shape == ref.shape == (int(grid.prod()) // 4, 64)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_mrope_positions_match_transformers(llm, ckpt):
    from pagedllm.multimodal.mrope import mrope_rows

    _, hf, proc = ckpt
    ip = llm.llm_engine.input_processor.image_processor
    text = f"w5 {IMG} w9 w10 {IMG} w33 {IMG} w8"
    old, ip.limit = ip.limit, 3
    try:
        ids, feats = ip.process(text, IMAGES, add_special_tokens=True)
    finally:
        ip.limit = old
    assert [f.grid_thw for f in feats] == [tuple(g) for g in proc(text=text, images=IMAGES)["image_grid_thw"].tolist()]
    out = proc(text=text, images=IMAGES, return_tensors="pt")
    assert ids == out["input_ids"][0].tolist()
    ref, ref_delta = hf.model.get_rope_index(out["input_ids"], out["mm_token_type_ids"], out["image_grid_thw"])
    pos = np.arange(len(ids), dtype=np.int64)
    rows, delta = mrope_rows(pos, feats, 2)
    assert rows.tolist() == ref[:, 0].tolist()
    assert delta == int(ref_delta[0, 0]) and delta < 0
    # any subset of positions (a prefill chunk, a prefix-cache hit's tail) gets the same rows
    part = pos[17:29]
    assert mrope_rows(part, feats, 2)[0].tolist() == ref[:, 0, 17:29].tolist()


def test_generate_matches_transformers(llm, ckpt):
    _, hf, proc = ckpt
    img = image(1)
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, TEXT, [img], N)
    o, toks, lps = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert o.prompt_token_ids == ids
    assert toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)


def test_prompt_logits_match_transformers(llm, ckpt):
    """Every prompt position's log-probability (the decoder's logits through M-RoPE on text, image and
    post-image tokens) against transformers' forward of the same prompt."""
    _, hf, proc = ckpt
    imgs = [image(5), image(6, size=(20, 50))]
    inputs = proc(text=TWO, images=imgs, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**inputs).logits[0].float()
    ids = inputs["input_ids"][0]
    ref = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
    o = llm.generate({"prompt": TWO, "multi_modal_data": {"image": imgs}},
                     SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    got = [next(v.logprob for k, v in d.items() if k == t) for d, t in zip(o.prompt_logprobs[1:], ids[1:].tolist())]
    torch.testing.assert_close(torch.tensor(got), ref, atol=1e-4, rtol=1e-4)


def test_two_images_and_prefix_cache(llm, ckpt):
    _, hf, proc = ckpt
    imgs = [image(2), image(3, size=(20, 50))]
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, TWO, imgs, N)
    o, toks, lps = _run(llm, {"prompt": TWO, "multi_modal_data": {"image": imgs}})
    assert o.prompt_token_ids == ids and toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)
    # the same images again: a prefix-cache hit past both images, the same tokens and logprobs
    o2, toks2, lps2 = _run(llm, {"prompt": TWO, "multi_modal_data": {"image": imgs}})
    assert toks2 == ref and (o2.num_cached_tokens or 0) >= 32
    assert lps2 == pytest.approx(ref_lp, abs=1e-4)
    # other images of the same sizes in the same places: no stale hit, transformers' answer
    other = [image(7), image(8, size=(20, 50))]
    _, ref3, _ = hf_greedy_mm(hf, proc, TWO, other, N)
    assert _run(llm, {"prompt": TWO, "multi_modal_data": {"image": other}})[1] == ref3


def test_batch_of_image_and_text_requests(llm, ckpt):
    """Requests with different images and a text-only one in one batch (decodes of each keep their own
    M-RoPE offset)."""
    _, hf, proc = ckpt
    prompts = [{"prompt": TEXT, "multi_modal_data": {"image": image(9)}},
               {"prompt": "w40 w41 w42", "multi_modal_data": None},
               {"prompt": TWO, "multi_modal_data": {"image": [image(10, size=(64, 24)), image(11)]}}]
    refs = [hf_greedy_mm(hf, proc, TEXT, [image(9)], N)[1]]
    tok = proc.tokenizer("w40 w41 w42", return_tensors="pt")
    with torch.no_grad():
        g = hf.generate(**tok, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0, eos_token_id=None)
    refs.append(g[0, tok["input_ids"].shape[1]:].tolist())
    refs.append(hf_greedy_mm(hf, proc, TWO, [image(10, size=(64, 24)), image(11)], N)[1])
    outs = llm.generate([p if p["multi_modal_data"] else p["prompt"] for p in prompts], greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    # the runner's per-request M-RoPE offsets (one int per unfinished request) go with the requests (the
    # runner hears of a finish on the next step: the image requests' are dropped by the next request's)
    deltas = llm.llm_engine.core.executor.driver_worker.runner.mrope.deltas
    assert 1 <= len(deltas) <= 2 and all(d < 0 for d in deltas.values())
    llm.generate("w5 w6", greedy(1), use_tqdm=False)
    assert deltas == {}


def test_chat_with_image_part(llm, ckpt):
    _, hf, proc = ckpt
    img = image(12)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}, {"type": "image_pil", "image_pil": img}]}]
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "w40 w41"},
                                                                 {"type": "image"}]}], add_generation_prompt=True)
    _, ref, _ = hf_greedy_mm(hf, proc, text, [img], N)
    o = llm.chat(msgs, greedy(), use_tqdm=False)[0]
    assert list(o.outputs[0].token_ids) == ref


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_load_both_name_layouts(layout, ckpt):
    """transformers 5's names (``model.visual.*``, ``model.language_model.*``) and the Hub checkpoints'
    (``visual.*``, ``model.*``): the same image embeddings and logits as transformers."""
    from pagedllm.models.registry import get_model_class

    _, hf, proc = ckpt
    sd = hf.state_dict()
    if layout == "hub":
        sd = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
              for k, v in sd.items()}
    ours = get_model_class(["Qwen2_5_VLForConditionalGeneration"])(hf.config, torch.float32)
    ours.load_weights(sd.items())
    out = proc(text=TEXT, images=[image(13)], return_tensors="pt")
    with torch.no_grad():
        ref = hf.model.get_image_features(out["pixel_values"], out["image_grid_thw"]).pooler_output[0]
    got = ours.embed_images(out["pixel_values"], tuple(out["image_grid_thw"][0].tolist()))[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight)


def test_mrope_rotary_matches_transformers(ckpt):
    """``MRotaryEmbedding`` on ``[3, T]`` positions = transformers' ``Qwen2_5_VLRotaryEmbedding`` +
    ``apply_rotary_pos_emb``; ``[T]`` positions = an ordinary rope."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    _, hf, _ = ckpt
    from pagedllm.models.qwen2_5_vl import Qwen2_5_VLTextModel, Qwen2_5_VLForConditionalGeneration

    text_cfg = hf.config.text_config
    rope = Qwen2_5_VLTextModel(text_cfg, Qwen2_5_VLForConditionalGeneration).rotary
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300, (3, 9), generator=g)
    q, k = torch.randn(9, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    cos, sin = Qwen2_5_VLRotaryEmbedding(text_cfg)(q, pos[:, None])
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    gq, gk = rope.forward(pos, q.clone(), k.clone())
    torch.testing.assert_close(gq, rq[0].transpose(0, 1))
    torch.testing.assert_close(gk, rk[0].transpose(0, 1))
    same = pos[0].expand(3, -1)
    torch.testing.assert_close(rope.forward(same, q, k)[0], rope.forward(pos[0], q, k)[0])
