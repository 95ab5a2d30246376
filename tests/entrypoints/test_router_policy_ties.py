"""The router policy's tie breaks of equal load (``PolicyConfig.tie_break``): in turn (the default),
the first (sgl-router's), random (the Gateway API Inference Extension's picker, llm-d)."""
from __future__ import annotations

import pytest

from pagedllm.router.policy import PolicyConfig, Router


def _picks(tie_break: str, n: int = 12, seed: int = 0) -> list[int]:
    r = Router("least-load", PolicyConfig(tie_break=tie_break, tie_seed=seed))
    return [r.choose([0, 1, 2], [0, 0, 0]).replica for _ in range(n)]


def test_ties_in_turn_first_and_random():
    assert _picks("turn") == [0, 1, 2] * 4
    assert _picks("first") == [0] * 12
    rnd = _picks("random", 60)
    assert set(rnd) == {0, 1, 2} and rnd == _picks("random", 60)  # deterministic for a seed
    assert rnd != _picks("random", 60, seed=1)
    # a unique least-loaded replica wins whatever the tie break
    for tb in ("turn", "first", "random"):
        assert Router("least-load", PolicyConfig(tie_break=tb)).choose([0, 1, 2], [3, 1, 2]).replica == 1


def test_default_turn_counter_unchanged_by_unique_minimum():
    r = Router("least-load")
    assert r.choose([0, 1], [1, 0]).replica == 1  # (advances the turn counter, as before)
    assert r.choose([0, 1], [0, 0]).replica == 1


def test_bad_tie_break_is_an_error():
    with pytest.raises(ValueError, match="tie_break"):
        Router("least-load", PolicyConfig(tie_break="coin"))
