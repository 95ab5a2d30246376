"""A tiny random Qwen2.5-VL checkpoint built with transformers (configs scaled down): a 2-block vision
tower (patch 4, 2x2 merge, 16 px windows so an image has several attention windows, block 1 full
attention), a 2-layer Qwen2 decoder with M-RoPE (``mrope_section`` [2, 3, 3] of head_dim 16), a
word-level tokenizer that knows Qwen's vision markers, the model's own ``Qwen2_5_VLProcessor``
(dynamic resolution: a 40x32 image -> an 8x10 patch grid -> 20 image tokens) and a small chat
template with image parts, saved as the Hub lays them out."""
from __future__ import annotations

import json
import os
import sys

import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from arch_cases import VOCAB, build_hf  # noqa: E402

from pagedllm.multimodal.processing import make_image_only_processor  # noqa: E402

QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# the words users send: w3 .. w199; w10 = user turn, w11 = assistant turn, w12 = end of turn
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %} {% endfor %}{% endif %} w12 {% endfor %}{% if add_generation_prompt %}w11 {% endif %}")


def _tokenizer():
    from vlm_helpers import tiny_vlm_tokenizer

    tok = tiny_vlm_tokenizer(QWEN_SPECIAL)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def qwen2_5_vl_config():
    tok = _tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def make_qwen2_5_vl_checkpoint(path: str, seed: int = 0):
    """Save a tiny Qwen2.5-VL model, tokenizer and ``Qwen2_5_VLProcessor`` to ``path``; returns ``(hf, processor)``."""
    model = build_hf(qwen2_5_vl_config(), "Qwen2_5_VLForConditionalGeneration", seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    ip = tf.Qwen2VLImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                  max_pixels=64 * 64)
    tok = _tokenizer()
    # NOTE: transformers' Qwen2_5_VLProcessor wants a video processor, which needs torchvision (not a
    # dependency): the image-only processor the engine builds in that case, saved as the Hub lays it out
    proc = make_image_only_processor(tf.Qwen2_5_VLProcessor, ip, tok, CHAT_TEMPLATE)
    ip.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2_5_VLProcessor"}, f)
    return model, proc
