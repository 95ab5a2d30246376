"""Tiny random-weight checkpoints for engine and server tests (shared; import from test modules
as ``from tiny_models import save_tiny_llama``).

Every checkpoint is a transformers ``LlamaForCausalLM`` (2 layers, hidden 64, GQA 4/2, head_dim 16,
float32) saved with a real tokenizer, so the engine loads it like any Hugging Face directory.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

#: Bytes of one KV block of ``save_tiny_llama``'s model: layers * K/V * kv heads * head_dim *
#: float32 * block_size 16.
TINY_LLAMA_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16


def save_tiny_llama(d: str, tok: Any, seed: int, *, std: Optional[float] = 0.2,
                    max_position_embeddings: int = 512, **config: Any) -> str:
    """Write a tiny random Llama with tokenizer ``tok`` (its vocabulary size) to directory ``d``.

    Args:
        seed: ``torch.manual_seed`` before the weights are made (same seed, same weights).
        std: every parameter redrawn from N(0, std) (0.2 spreads the logits so greedy outputs do
            not tie); None keeps transformers' own initialisation.
        config: more ``LlamaConfig`` fields (``tie_word_embeddings``, ``eos_token_id``, ...);
            the default head is untied.

    Returns:
        ``d``.
    """
    import transformers as tf

    cfg = tf.LlamaConfig(**{"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 16, "max_position_embeddings": max_position_embeddings,
                            "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"], **config})
    torch.manual_seed(seed)
    m = tf.LlamaForCausalLM(cfg).float().eval()
    if std is not None:
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, std)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d
