"""Tiny random HF checkpoints for the tensor/pipeline-parallel tests, and engine fixtures that
stop every worker process they start (also when a test fails)."""
from __future__ import annotations

import os

import pytest
import torch


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_tiny(root: str, name: str, arch: str = "LlamaForCausalLM", seed: int = 0, **over) -> str:
    """A tiny random transformers checkpoint (vocab 256, hidden 64, 4 layers, 4 query / 2 KV
    heads unless overridden) with a word-level tokenizer; returns its directory."""
    import transformers

    d = os.path.join(root, name)
    if os.path.isdir(d):
        return d
    family = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2"}[arch]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, architectures=[arch], bos_token_id=1, eos_token_id=2)
    kw.update(over)
    cfg = getattr(transformers, f"{family}Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases; logits spread enough for stable greedy picks
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.normal_(0, 0.05)
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight.mul_(8.0)
        else:
            model.model.embed_tokens.weight.mul_(4.0)
    model.save_pretrained(d)
    _word_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny_parallel"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_root) -> str:
    """Untied Llama, 4 query / 2 KV heads, o_proj and MLP biases (``attention_bias``, ``mlp_bias``)."""
    return write_tiny(tiny_root, "llama", attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="session")
def tiny_qwen2_tied_dir(tiny_root) -> str:
    """Tied Qwen2 (q/k/v bias), 6 query / 3 KV heads, vocab 255 (not a multiple of 2: padded
    vocabulary shards), 5 layers (uneven pipeline stages)."""
    return write_tiny(tiny_root, "qwen2_tied", "Qwen2ForCausalLM", seed=1, tie_word_embeddings=True,
                      num_attention_heads=6, num_key_value_heads=3, hidden_size=96, vocab_size=255,
                      num_hidden_layers=5)


@pytest.fixture
def make_llm():
    """Factory ``make_llm(model, **kwargs) -> LLM``; every engine it made is shut down at teardown."""
    from pagedllm import LLM

    made = []

    def make(model, **kw):
        kw.setdefault("dtype", "float32")
        kw.setdefault("kv_cache_memory", 4 * 1024**2)
        llm = LLM(model, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()
