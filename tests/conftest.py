"""Shared fixtures. Real models and their transformers references load once per session."""
from __future__ import annotations

import os

os.environ.setdefault("PAGEDLLM_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pagedllm.loader import get_smollm2_gguf_path
    return get_smollm2_gguf_path()


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    from pagedllm.loader import get_gemma3_gguf_path
    return get_gemma3_gguf_path()


def _hf_from_gguf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """(transformers LlamaForCausalLM fp32, tokenizer) from the SmolLM2 GGUF (~15 s)."""
    return _hf_from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path):
    """(transformers Gemma3ForCausalLM fp32, tokenizer) from the Gemma 3 GGUF (~40 s)."""
    return _hf_from_gguf(gemma3_path)


@pytest.fixture(scope="session")
def smollm2_llm():
    """A float32 SmolLM2 LLM shared by the real-model engine tests: the Q4_1 file dequantized at load
    (``quantization="none"``), the same float32 weights transformers uses (the default, native
    blocks, is covered by tests/quantization/test_gguf_blocks.py)."""
    from pagedllm import LLM
    return LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=256 * 1024**2,
               max_num_batched_tokens=512, seed=0, quantization="none")


def make_tiny_llama(tie: bool, dtype: torch.dtype = torch.float32, std: float = 0.02):
    """A 2-layer random pagedllm Llama (vocab 512, hidden 128, GQA 4/2) with fixed weights:
    norms 1, embeddings N(0, 1), other matrices N(0, std); built in ``dtype``."""
    from transformers import LlamaConfig

    from pagedllm.models.llama import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 1.0 if "embed" in name else (std if p.dim() > 1 else 0.0))
    return model.eval()


@pytest.fixture
def tiny_llama():
    """Factory fixture: ``tiny_llama(tie, dtype=torch.float32, std=0.02)`` (see ``make_tiny_llama``)."""
    return make_tiny_llama
