"""Loader-test fixtures. The GGUF paths and the transformers references come from the root conftest
(``smollm2_path``, ``gemma3_path``, ``hf_smollm2``, ``hf_gemma3``), so each reference loads once per session."""

import pytest


def _state(hf_pair):
    model, _ = hf_pair
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="session")
def hf_smollm2_state(hf_smollm2):
    """transformers' own GGUF load of SmolLM2 (state dict, float32)."""
    return _state(hf_smollm2)


@pytest.fixture(scope="session")
def hf_gemma3_state(hf_gemma3):
    """transformers' own GGUF load of Gemma 3 270M (state dict, float32)."""
    return _state(hf_gemma3)
