"""Fixtures for the speculative decoding tests (helpers in spec_helpers.py)."""
import pytest

from spec_helpers import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("spec_tiny") / "llama"))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> str:
    from spec_helpers import write_tiny_gemma3

    return write_tiny_gemma3(str(tmp_path_factory.mktemp("spec_tiny_g3") / "gemma3"))
