"""Structured-output fixtures: the real tokenizers (no model weights); helpers are in so_helpers.py."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from pagedllm.loader.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_path)
