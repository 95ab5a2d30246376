"""Helpers of the structured-output tests: SmolLM2's vocabulary facts and walks of a grammar
through its token bitmasks (a module of its own, since ``from conftest import ...`` may pick up
another directory's conftest when files of several directories share a process)."""
from __future__ import annotations

import random

import torch

SMOLLM2_VOCAB = 49152
SMOLLM2_EOS = 2

def allowed_ids(matcher, vocab_size: int) -> list[int]:
    """Token ids the matcher allows next (its bitmask, unpacked bit by bit)."""
    from pagedllm.sample.bitmask import unpack_bitmask
    bm = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_bitmask(bm, 0)
    return unpack_bitmask(bm, vocab_size)[0].nonzero().squeeze(1).tolist()


def random_walk(matcher, vocab_size: int, eos: int, rng: random.Random, max_steps: int = 64,
                eos_bias: float = 0.0) -> tuple[list[int], bool]:
    """Sample uniformly among the allowed tokens (EOS with probability ``eos_bias`` when
    allowed) until EOS; returns (tokens without EOS, ended with EOS)."""
    out: list[int] = []
    for _ in range(max_steps):
        ids = allowed_ids(matcher, vocab_size)
        assert ids, "the grammar allows nothing (not even EOS)"
        t = eos if (eos in ids and rng.random() < eos_bias) else rng.choice(ids)
        assert matcher.accept_tokens([t])
        if t == eos:
            return out, True
        out.append(t)
    return out, False
