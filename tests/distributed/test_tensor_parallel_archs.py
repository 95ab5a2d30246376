"""Tensor parallelism (2 ranks) on the new architectures' tiny checkpoints (``tests/arch_cases.py``): the
same greedy tokens and logprobs (1e-4) as one rank. Phi-3's fused checkpoint tensors go through the
per-shard (sliced) loaders; MoE experts stay whole on every rank (their output needs no reduction),
Qwen2-MoE's shared expert is split like any MLP."""
from __future__ import annotations

import pytest
from arch_cases import PROMPTS, make_checkpoint
from test_tensor_parallel import _assert_same, _run

CASES = ["phi3", "gemma2", "qwen2_moe", "mixtral"]


@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_one_rank(make_llm, tmp_path, case):
    make_checkpoint(case, str(tmp_path))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _run(make_llm(str(tmp_path)), prompts, max_tokens=8)
    _assert_same(ref, _run(make_llm(str(tmp_path), tensor_parallel_size=2), prompts, max_tokens=8))
