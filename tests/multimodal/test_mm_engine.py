"""Images end to end through ``LLM`` on a tiny random Gemma 3 image-text checkpoint (tests/multimodal/
mm_helpers.py) against transformers on the same weights, processor and images: greedy tokens and
logprobs, ``LLM.chat`` with image parts, chunked prefill around image runs, the image-aware prefix
cache, the encoder cache bound, and bad inputs."""

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mm_helpers import hf_greedy_mm, image, make_gemma3_mm_checkpoint, greedy_params, run_greedy, runner_model  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.input_processor import InputValidationError  # noqa: E402
from pagedllm.multimodal.encoder_cache import EncoderCache  # noqa: E402

N = 8
TEXT = "w5 w7 <start_of_image> w9 w20 w31"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gemma3mm"))
    hf, proc = make_gemma3_mm_checkpoint(d)
    return d, hf, proc


@pytest.fixture(scope="module")
def llm(ckpt):
    # block_size 4 and an 8-token budget: prompts are prefilled in chunks, image runs kept whole
    return LLM(ckpt[0], dtype="float32", max_model_len=64, block_size=4, max_num_batched_tokens=8,
               limit_mm_per_prompt={"image": 2}, encoder_cache_size=8)


def greedy(n=N):
    return greedy_params(n)


def _run(llm, prompt):
    return run_greedy(llm, prompt, N)


def test_generate_matches_transformers(ckpt, llm):
    _, hf, proc = ckpt
    img = image(1)
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, TEXT, [img], N)
    o, toks, lps = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert o.prompt_token_ids == ids
    assert toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)


def test_two_images_match_transformers(ckpt, llm):
    _, hf, proc = ckpt
    text = "w5 <start_of_image> w9 <start_of_image> w33"
    imgs = [image(2), image(3, size=(20, 50))]
    ids, ref, _ = hf_greedy_mm(hf, proc, text, imgs, N)
    o, toks, _ = _run(llm, {"prompt": text, "multi_modal_data": {"image": imgs}})
    assert o.prompt_token_ids == ids and toks == ref


def test_chat_with_image_part(ckpt, llm):
    _, hf, proc = ckpt
    img = image(4)
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                          {"type": "text", "text": "w40 w41"}]}]
    hf_text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                      {"type": "text", "text": "w40 w41"}]}],
                                       add_generation_prompt=True, tokenize=False)
    inputs = proc(text=hf_text, images=[img], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, inputs["input_ids"].shape[1]:].tolist()
    o = llm.chat(msgs, greedy(), use_tqdm=False)[0]
    assert o.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(o.outputs[0].token_ids) == ref


def test_prefix_cache_keyed_by_image(llm):
    a, b = image(10), image(11)
    text = "w3 w4 w5 w6 w7 w8 w9 w13 <start_of_image> w14 w15 w16 w17 w18"
    first, t1, lp1 = _run(llm, {"prompt": text, "multi_modal_data": {"image": a}})
    again, t2, lp2 = _run(llm, {"prompt": text, "multi_modal_data": {"image": a.copy()}})
    other, t3, lp3 = _run(llm, {"prompt": text, "multi_modal_data": {"image": b}})
    assert t2 == t1 and lp2 == pytest.approx(lp1, abs=1e-5)
    start = first.prompt_token_ids.index(255)  # the first image placeholder
    # the same image: the blocks past the image hit; another image: only the blocks before it
    assert again.num_cached_tokens >= start + 4
    assert other.num_cached_tokens <= start
    assert other.num_cached_tokens > 0
    assert abs(lp3[0] - lp1[0]) > 1e-4  # the other image's embeddings were used, not the cached KV


def test_encoder_cache_bound_and_counts(llm):
    ec = llm.llm_engine.core.executor.driver_worker.runner.encoder_cache
    assert ec.capacity == 8
    ev0 = ec.evictions
    for s in range(20, 24):  # four new images of 4 tokens into an 8-token cache
        _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": image(s)}})
        assert ec.usage <= ec.capacity
    assert ec.evictions - ev0 >= 2
    stats = llm.llm_engine.core.get_scheduler_stats()["encoder_cache"]
    assert stats["capacity"] == 8 and stats["usage"] <= 8 and stats["evictions"] >= 2


def test_encoder_cache_unit():
    c = EncoderCache(10)
    t = torch.zeros
    assert c.put("a", t(4, 2)) and c.put("b", t(4, 2))
    c.ref("a", "r1")
    assert c.put("c", t(4, 2))  # evicts b (a is referenced)
    assert set(c.entries) == {"a", "c"} and c.usage == 8 and c.evictions == 1
    assert not c.put("d", t(11, 2))  # larger than the bound: not kept, nothing evicted
    assert c.usage == 8 and c.get("d") is None and c.get("a") is not None
    c.release_request("r1")
    assert c.put("e", t(8, 2)) and c.usage <= 10


@pytest.mark.parametrize("prompt,field", [
    ({"prompt": "w5 <start_of_image> w6 <start_of_image> <start_of_image>",
      "multi_modal_data": {"image": [image(1)] * 3}}, "multi_modal_data"),
    ({"prompt": TEXT, "multi_modal_data": {"image": "not an image"}}, "multi_modal_data"),
    ({"prompt": TEXT, "multi_modal_data": {"video": image(1)}}, "multi_modal_data"),
    ({"prompt": "w5 w6", "multi_modal_data": {"image": image(1)}}, "multi_modal_data"),
])
def test_bad_inputs(llm, prompt, field):
    with pytest.raises(InputValidationError) as e:
        llm.generate(prompt, greedy(), use_tqdm=False)
    assert e.value.param == field
    # the engine still serves
    assert len(llm.generate("w5 w6", greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_chat_bad_image_url(llm):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(InputValidationError, match="cannot decode"):
        llm.chat(msgs, greedy(), use_tqdm=False)
    msgs[0]["content"][0]["image_url"]["url"] = "http://example.com/x.png"
    with pytest.raises(InputValidationError, match="remote image URLs are disabled"):
        llm.chat(msgs, greedy(), use_tqdm=False)
    msgs[0]["content"][0]["image_url"]["url"] = "file:///etc/passwd"
    with pytest.raises(InputValidationError, match="allowed-local-media-path"):
        llm.chat(msgs, greedy(), use_tqdm=False)


def test_text_only_model_refuses_images(tmp_path):
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    from arch_cases import make_checkpoint

    make_checkpoint("llama", str(tmp_path))
    text_llm = LLM(str(tmp_path), dtype="float32", max_model_len=32)
    with pytest.raises(InputValidationError, match="does not take images") as e:
        text_llm.generate({"prompt": "w5 w6", "multi_modal_data": {"image": image(1)}}, greedy(), use_tqdm=False)
    assert e.value.param == "multi_modal_data"
    with pytest.raises(InputValidationError, match="does not take images"):
        text_llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(1)}]}], greedy(),
                      use_tqdm=False, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_mm_chunk_end_never_splits_a_bidirectional_run():
    from pagedllm.core.scheduler import mm_chunk_end
    from pagedllm.multimodal import MultiModalFeature

    bi = [MultiModalFeature("image", "h", 10, 4, None, True)]
    assert mm_chunk_end(bi, 0, 8) == 8  # ends before the run
    assert mm_chunk_end(bi, 0, 12) == 10  # would end inside: stops before it
    assert mm_chunk_end(bi, 8, 8) == 8  # covers the whole run
    assert mm_chunk_end(bi, 11, 2) == 0  # starts inside (a prefix hit) and cannot reach its end
    causal = [MultiModalFeature("image", "h", 10, 4, None, False)]
    assert mm_chunk_end(causal, 0, 12) == 12  # a causal run may be split
