"""Tiny random checkpoints written by the tests (HF format, SmolLM2's tokenizer), and the
GemmaDecision encoder directory written by ``examples/export_gemma_encoder.py``."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from pagedllm.loader.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_path)


def write_tiny(root: str, name: str, arch: str, tokenizer, num_labels: int = 0, seed: int = 0) -> str:
    """Write a tiny random transformers model (``arch``: LlamaForCausalLM, LlamaForSequenceClassification,
    Qwen2ForSequenceClassification) with the given tokenizer; return its directory."""
    import transformers

    d = os.path.join(root, name)
    if os.path.isdir(d):
        return d
    family = "Qwen2" if arch.startswith("Qwen2") else "Llama"
    cfg_cls = getattr(transformers, f"{family}Config")
    pad = 0  # "<|endoftext|>": never produced by encoding plain text
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=pad, tie_word_embeddings=False, architectures=[arch])
    if family == "Llama":
        kw["head_dim"] = 16
    if num_labels:
        kw["num_labels"] = num_labels
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms, and a head with visible output range
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
        if num_labels:
            model.score.weight.mul_(20.0)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny_pooling"))


@pytest.fixture(scope="session")
def tiny_llama_cls3(tiny_root, smollm2_tokenizer) -> str:
    return write_tiny(tiny_root, "llama_cls3", "LlamaForSequenceClassification", smollm2_tokenizer, 3, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_cls1(tiny_root, smollm2_tokenizer) -> str:
    return write_tiny(tiny_root, "qwen2_cls1", "Qwen2ForSequenceClassification", smollm2_tokenizer, 1, seed=2)


@pytest.fixture(scope="session")
def tiny_llama_causal(tiny_root, smollm2_tokenizer) -> str:
    return write_tiny(tiny_root, "llama_causal", "LlamaForCausalLM", smollm2_tokenizer, 0, seed=3)


@pytest.fixture(scope="session")
def gemma_encoder_dir(gemma3_path, tmp_path_factory) -> str:
    """The bare Gemma3TextModel encoder directory (float32) exported from the Gemma 3 GGUF by the
    user-facing example program (about 1 GB; a minute or two on a busy machine)."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from example_loader import load_example

    ex = load_example("export_gemma_encoder")
    return ex.export_encoder(str(tmp_path_factory.mktemp("gemma_encoder")), gemma3_path)
