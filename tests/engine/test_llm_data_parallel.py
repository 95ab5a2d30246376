"""Offline data parallelism: ``LLM(data_parallel_size=2)`` splits a batch over two replica
processes and returns the outputs in input order, equal to one engine's."""
from __future__ import annotations

import pytest

from arch_cases import make_checkpoint

KW = dict(dtype="float32", num_threads=1, block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dp_tiny"))
    make_checkpoint("llama", path)
    return path


def test_data_parallel_outputs_equal_one_engine_in_order(tiny):
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.llm_dp import DataParallelLLM

    prompts = [{"prompt_token_ids": [1 + i, 17, 3 + 2 * i, 88, 42 - i]} for i in range(5)]
    params = [SamplingParams(max_tokens=3 + i, temperature=0, ignore_eos=True) for i in range(5)]
    one = LLM(tiny, **KW)
    ref = one.generate(prompts, params, use_tqdm=False)
    one.shutdown()
    dp = LLM(tiny, data_parallel_size=2, **KW)
    try:
        assert isinstance(dp, DataParallelLLM) and isinstance(dp, LLM)
        out = dp.generate(prompts, params, use_tqdm=False)
        assert [o.prompt_token_ids for o in out] == [p["prompt_token_ids"] for p in prompts]
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
        assert [len(o.outputs[0].token_ids) for o in out] == [3, 4, 5, 6, 7]
        # One prompt (fewer prompts than replicas) and the replicas' shared calls.
        single = dp.generate(prompts[2], params[2], use_tqdm=False)
        assert single[0].outputs[0].token_ids == ref[2].outputs[0].token_ids
        assert dp.reset_prefix_cache() is True
        assert dp.get_tokenizer().decode([5, 6]) == one.get_tokenizer().decode([5, 6])
    finally:
        dp.shutdown()


def test_data_parallel_replica_errors_reach_the_caller(tiny):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny, data_parallel_size=2, **dict(KW, max_num_batched_tokens=0))
