"""Session fixtures for loader tests: real GGUF paths and the transformers reference loads (10-25 s each)."""

import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path():
    from pagedllm.loader import get_smollm2_gguf_path

    try:
        return get_smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3_path():
    from pagedllm.loader import get_gemma3_gguf_path

    try:
        return get_gemma3_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))


def _hf_gguf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="session")
def hf_smollm2_state(smollm2_path):
    """transformers' own GGUF load of SmolLM2 (state dict, float32)."""
    return _hf_gguf_model(smollm2_path)


@pytest.fixture(scope="session")
def hf_gemma3_state(gemma3_path):
    """transformers' own GGUF load of Gemma 3 270M (state dict, float32)."""
    return _hf_gguf_model(gemma3_path)
