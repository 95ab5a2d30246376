"""Fixtures of the LoRA tests: a tiny random transformers Llama and PEFT adapters made on it."""
from __future__ import annotations

import os

import pytest

from lora_helpers import make_peft_adapter, tiny_hf_llama


@pytest.fixture(scope="session")
def hf_tiny():
    return tiny_hf_llama()


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lora_adapters"))


@pytest.fixture(scope="session")
def tiny_adapters(hf_tiny, adapter_root) -> dict[str, str]:
    """Four adapters on ``hf_tiny``: "all" (every target, r 8), "rslora" (rsLoRA, r 4), "qv" (q and
    v only, r 2) and "pattern" (rank_pattern / alpha_pattern: r 8 with down_proj at r 4)."""
    return {
        "all": make_peft_adapter(hf_tiny, os.path.join(adapter_root, "all"), r=8, alpha=16, seed=1),
        "rslora": make_peft_adapter(hf_tiny, os.path.join(adapter_root, "rslora"), r=4, alpha=8, seed=2,
                                    use_rslora=True),
        "qv": make_peft_adapter(hf_tiny, os.path.join(adapter_root, "qv"), r=2, alpha=4, seed=3,
                                targets=["q_proj", "v_proj"], b_std=0.3),
        "pattern": make_peft_adapter(hf_tiny, os.path.join(adapter_root, "pattern"), r=8, alpha=8, seed=4,
                                     rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}),
    }


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(checkpoint dir, transformers model, {adapter name: PEFT dir}): a tiny random Llama saved
    with a word-level tokenizer, and four adapters made on it with peft."""
    from lora_helpers import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora_tiny_ckpt")
    hf = write_tiny_checkpoint(str(root / "model"))
    adapters = {
        "a1": make_peft_adapter(hf, str(root / "a1"), r=8, alpha=16, seed=11, b_std=0.2),
        "a2": make_peft_adapter(hf, str(root / "a2"), r=4, alpha=8, seed=12, b_std=0.3, use_rslora=True),
        "a3": make_peft_adapter(hf, str(root / "a3"), r=8, alpha=16, seed=13, b_std=0.3,
                                targets=["q_proj", "v_proj", "gate_proj", "down_proj"]),
        "a4": make_peft_adapter(hf, str(root / "a4"), r=2, alpha=4, seed=14, b_std=0.5),
    }
    return str(root / "model"), hf, adapters
