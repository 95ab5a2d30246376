"""Write a random-weight LLaVA checkpoint (CLIP 224 px / patch 14 -> 256 image tokens, hidden 192, 4 layers;
Llama decoder hidden 256, 4 layers, vocab 512 word-level) with its LlavaProcessor to DIR, for
``pagedllm bench image`` on a machine without Hub access. Usage: python scripts/make_random_llava.py DIR"""
import sys

import torch
import transformers as tf
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

VOCAB = 512


def main(path: str) -> None:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB - 1)] + ["<image>"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = tf.CLIPVisionConfig(hidden_size=192, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                                 image_size=224, patch_size=14, projection_dim=192)
    cfg = tf.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=VOCAB - 1,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    ip = tf.CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    tf.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                      num_additional_image_tokens=1).save_pretrained(path)


if __name__ == "__main__":
    main(sys.argv[1])
