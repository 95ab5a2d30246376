"""A tiny random Llama checkpoint (HF directory, word-level tokenizer) for engine-level
speculative decoding tests: random weights loop on short cycles, so n-gram/suffix drafts are
often accepted and often rejected."""
from __future__ import annotations

import os

import torch

TINY_VOCAB = 128


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY_VOCAB - 3)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_tiny_llama(d: str, seed: int = 0, layers: int = 2) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isdir(d):
        return d
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() > 1:
                # NOTE: small layer weights: the model falls into cycles and half-repeats, so
                # drafts are often, but far from always, accepted.
                p.normal_(0, 1.0 if "embed" in n else (0.25 if "lm_head" in n else 0.1))
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def tiny_prompts(n: int = 8, seed: int = 0) -> list[dict]:
    """``n`` token-id prompts of 12-40 tokens, each with a repeated stretch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(6, 20, (1,), generator=g))
        base = torch.randint(3, TINY_VOCAB, (L,), generator=g).tolist()
        out.append({"prompt_token_ids": base + base[: L // 2] + base})
    return out
