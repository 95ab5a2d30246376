"""A tiny random transformers Llama checkpoint with a word-level tokenizer, for engine tests that
compare with transformers on the same weights (beam search, sleep mode)."""
from __future__ import annotations

import torch


def word_tokenizer():
    """A word-level tokenizer over ``<unk> <s> </s> w0 .. w252`` (ids 0..255; EOS ``</s>`` = 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_tiny_llama(path: str, seed: int = 0, head_scale: float = 4.0, eos_boost: float = 1.0):
    """Save a random ``LlamaForCausalLM`` (vocab 256, hidden 64, 2 layers, 4 query / 2 KV heads,
    untied head scaled by ``head_scale`` so logits are spread: no near ties; the EOS row by
    ``eos_boost`` more, so that EOS wins sometimes) and the word tokenizer to ``path``; returns the
    transformers model (eager attention, float32, eval)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
        hf.lm_head.weight.mul_(head_scale)
        hf.lm_head.weight[2].mul_(eos_boost)
    hf.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    hf.config._attn_implementation = "eager"
    return hf
