"""A tiny random LLaVA-NeXT checkpoint (tests/multimodal/vlm_helpers.py: anyres pinpoints 28x56, 56x28,
56x56 over 28 px CLIP tiles) vs transformers on the same weights, processor and images: packed image
embeddings (base tile + unpadded tile grid + ``image_newline`` per row) for images of different aspect
ratios, greedy tokens and logprobs through ``LLM`` with prefill chunks inside image runs, two images of
different sizes in one prompt, the image-aware prefix cache, chat image parts and both name layouts."""

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mm_helpers import hf_greedy_mm, image, greedy_params, run_greedy, runner_model  # noqa: E402
from vlm_helpers import make_llava_next_checkpoint  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

N = 6
TEXT = "w5 w7 <image> w9 w20 w31"
TWO = "w5 <image> w9 <image> w33"
IMAGES = [image(2), image(3, size=(20, 50)), image(4, size=(64, 24)), image(5, size=(28, 28))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llava_next"))
    hf, proc = make_llava_next_checkpoint(d)
    return d, hf, proc


@pytest.fixture(scope="module")
def llm(ckpt):
    # block_size 4 and an 8-token budget: every image run is split across chunks
    return LLM(ckpt[0], dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=8,
               limit_mm_per_prompt={"image": 2}, encoder_cache_size=256)


def greedy(n=N):
    return greedy_params(n)


def _run(llm, prompt):
    return run_greedy(llm, prompt, N)


def _model(llm):
    return runner_model(llm)


def test_packed_image_embeddings_match(llm, ckpt):
    _, hf, proc = ckpt
    lengths = set()
    for img in IMAGES:
        out = proc(text=TEXT, images=[img], return_tensors="pt")
        with torch.no_grad():
            ref = hf.model.get_image_features(out["pixel_values"], out["image_sizes"]).pooler_output[0]
        got = _model(llm).embed_images(out["pixel_values"][0], tuple(out["image_sizes"][0].tolist()))[0]
        assert got.shape[0] == int((out["input_ids"] == hf.config.image_token_id).sum())
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        lengths.add(got.shape[0])
    assert len(lengths) >= 3  # the run length follows the image's aspect ratio


def test_generate_matches_transformers(llm, ckpt):
    _, hf, proc = ckpt
    for img in (image(1), image(6, size=(20, 50))):
        ids, ref, ref_lp = hf_greedy_mm(hf, proc, TEXT, [img], N)
        o, toks, lps = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
        assert o.prompt_token_ids == ids
        assert toks == ref
        assert lps == pytest.approx(ref_lp, abs=1e-4)


def test_two_images_and_prefix_cache(llm, ckpt):
    _, hf, proc = ckpt
    imgs = [image(2, size=(28, 28)), image(3, size=(64, 24))]  # 36 + 52 image tokens
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, TWO, imgs, N)
    o, toks, lps = _run(llm, {"prompt": TWO, "multi_modal_data": {"image": imgs}})
    assert o.prompt_token_ids == ids and toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)
    o2, toks2, _ = _run(llm, {"prompt": TWO, "multi_modal_data": {"image": imgs}})
    assert toks2 == ref and (o2.num_cached_tokens or 0) >= 32
    other = [image(7, size=(28, 28)), image(8, size=(64, 24))]
    _, ref3, _ = hf_greedy_mm(hf, proc, TWO, other, N)
    assert _run(llm, {"prompt": TWO, "multi_modal_data": {"image": other}})[1] == ref3


def test_chat_with_image_part(llm, ckpt):
    _, hf, proc = ckpt
    img = image(9, size=(50, 30))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}, {"type": "image_pil", "image_pil": img}]}]
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "w40 w41"},
                                                                 {"type": "image"}]}], add_generation_prompt=True)
    _, ref, _ = hf_greedy_mm(hf, proc, text, [img], N)
    o = llm.chat(msgs, greedy(), use_tqdm=False)[0]
    assert list(o.outputs[0].token_ids) == ref


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_load_both_name_layouts(layout, ckpt):
    """transformers 5's names (``model.image_newline``, ``model.vision_tower.*``, ...) and the llava-hf
    Hub layout (``image_newline``, ``vision_tower.*``, ``language_model.model.*``, ``language_model.lm_head``)."""
    from pagedllm.models.registry import get_model_class

    _, hf, proc = ckpt
    sd = hf.state_dict()
    if layout == "hub":
        def hub(k):
            if k.startswith("model.language_model."):
                return "language_model.model." + k[len("model.language_model."):]
            if k.startswith("lm_head."):
                return "language_model." + k
            return k[len("model."):] if k.startswith("model.") else k
        sd = {hub(k): v for k, v in sd.items()}
        assert "image_newline" in sd
    ours = get_model_class(["LlavaNextForConditionalGeneration"])(hf.config, torch.float32)
    ours.load_weights(sd.items())
    out = proc(text=TEXT, images=[image(10, size=(64, 24))], return_tensors="pt")
    with torch.no_grad():
        ref = hf.model.get_image_features(out["pixel_values"], out["image_sizes"]).pooler_output[0]
    got = ours.embed_images(out["pixel_values"][0], tuple(out["image_sizes"][0].tolist()))[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.image_newline.weight, hf.model.image_newline)
