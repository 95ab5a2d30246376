"""A tiny random Llama checkpoint (tests/arch_cases.py, 2 layers, vocab 256, 64 positions) shared
by the priority-scheduling, tracing and KV-event tests."""
import pytest

from arch_cases import make_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_checkpoint("llama", path)
    return path
