"""Tiny random LLaVA and Idefics3 (SmolVLM) checkpoints built with transformers (configs scaled down,
28x28 vision inputs), each with a word-level tokenizer that knows the model's image markers, the
model's own HF processor and a small chat template with image parts, saved as the Hub lays them out.

LLaVA: CLIP tower (patch 7 -> 16 patches + CLS; ``vision_feature_layer`` -2, CLS dropped) -> 16
``<image>`` tokens per image. Idefics3: 28x28 tiles (patch 7, pixel shuffle x2 -> 4 tokens per tile);
an image is resized to at most 56 px on its long side and split into up to 2x2 tiles plus the global
image, each tile its own ``<image>`` run."""
from __future__ import annotations

import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from arch_cases import VOCAB, build_hf  # noqa: E402

# the words users send: w3 .. w199; w10 = user turn, w11 = assistant turn, w12 = end of turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %} "
    "{% endfor %}{% endif %} w12 {% endfor %}{% if add_generation_prompt %}w11 {% endif %}")
LLAVA_IMAGE = VOCAB - 1  # "<image>"
IDEFICS_SPECIAL = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                   + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def tiny_vlm_tokenizer(specials: list[str]):
    """Word-level tokenizer: ``<unk> <s> </s> w3 ...`` then ``specials`` (added, special) at the top of
    the ``VOCAB``-sized vocabulary."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB - len(specials))] + list(specials)
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                     pad_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _text_config():
    return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def llava_config():
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=28, patch_size=7, projection_dim=32)
    return tf.LlavaConfig(text_config=_text_config().to_dict(), vision_config=vision.to_dict(),
                          image_token_id=LLAVA_IMAGE, vision_feature_layer=-2,
                          vision_feature_select_strategy="default", projector_hidden_act="gelu")


def idefics3_config():
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=28, patch_size=7)
    tok = tiny_vlm_tokenizer(IDEFICS_SPECIAL)
    return tf.Idefics3Config(text_config=_text_config().to_dict(), vision_config=vision.to_dict(), scale_factor=2,
                             image_token_id=tok.convert_tokens_to_ids("<image>"))


def make_llava_checkpoint(path: str, seed: int = 0):
    """Save a tiny LLaVA model, tokenizer and ``LlavaProcessor`` to ``path``; returns ``(hf, processor)``."""
    model = build_hf(llava_config(), "LlavaForConditionalGeneration", seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    ip = tf.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    proc = tf.LlavaProcessor(image_processor=ip, tokenizer=tiny_vlm_tokenizer(["<image>"]), patch_size=7,
                             vision_feature_select_strategy="default", num_additional_image_tokens=1,
                             chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(path)
    return model, proc


def make_idefics3_checkpoint(path: str, seed: int = 0):
    """Save a tiny Idefics3 model, tokenizer and ``Idefics3Processor`` to ``path``; returns ``(hf, processor)``."""
    model = build_hf(idefics3_config(), "Idefics3ForConditionalGeneration", seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    ip = tf.Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 28},
                                   do_image_splitting=True)
    proc = tf.Idefics3Processor(image_processor=ip, tokenizer=tiny_vlm_tokenizer(IDEFICS_SPECIAL), image_seq_len=4,
                                chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(path)
    return model, proc


def llava_next_config():
    """LLaVA-NeXT: the LLaVA tower (28 px tiles, 16 patches each) with anyres pinpoints 28x56, 56x28, 56x56."""
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=28, patch_size=7, projection_dim=32)
    return tf.LlavaNextConfig(text_config=_text_config().to_dict(), vision_config=vision.to_dict(),
                              image_token_index=LLAVA_IMAGE, vision_feature_layer=-2,
                              vision_feature_select_strategy="default", projector_hidden_act="gelu",
                              image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)


LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def make_llava_next_checkpoint(path: str, seed: int = 0):
    """Save a tiny LLaVA-NeXT model, tokenizer and ``LlavaNextProcessor`` to ``path``; returns ``(hf, processor)``."""
    model = build_hf(llava_next_config(), "LlavaNextForConditionalGeneration", seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    ip = tf.LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                    image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    proc = tf.LlavaNextProcessor(image_processor=ip, tokenizer=tiny_vlm_tokenizer(["<image>"]), patch_size=7,
                                 vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                 chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(path)
    return model, proc
