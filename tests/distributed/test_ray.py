"""The Ray backend on a local Ray instance: TP=2 (two actors, gloo) gives the single-rank
outputs; shutdown kills the actors and stops the instance it started."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from test_tensor_parallel import _assert_same, _run  # noqa: E402


def test_ray_tp2_matches_one_rank(make_llm, tiny_llama_dir):
    ref = _run(make_llm(tiny_llama_dir), prompt_logprobs=2)
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    ex = llm.llm_engine.core.executor
    assert type(ex).__name__ == "RayExecutor" and len(ex.actors) == 2
    _assert_same(ref, _run(llm, prompt_logprobs=2))
    llm.shutdown()
    assert not ray.is_initialized()
