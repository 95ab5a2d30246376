"""Tensor and pipeline parallelism on tiny random checkpoints (multiprocessing executor, gloo,
one thread per rank) against the same model on one rank: greedy tokens identical, logprobs
within 1e-4 (fp32; row-parallel sums add the K halves in another order, ~1e-6)."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams

PROMPTS = [
    {"prompt_token_ids": [1, 5, 9, 33, 7]},
    {"prompt_token_ids": [1] + list(range(40, 90))},
    {"prompt_token_ids": [1, 200, 201, 17, 17, 17, 4]},
    {"prompt_token_ids": [1] + [(7 * i) % 250 + 3 for i in range(130)]},
]


def _run(llm, prompts=PROMPTS, max_tokens=12, prompt_logprobs=None):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=4, prompt_logprobs=prompt_logprobs,
                        ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def _assert_same(ref, got, tol=1e-4):
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for k in la:
                assert abs(la[k].logprob - lb[k].logprob) <= tol, (k, la[k].logprob, lb[k].logprob)
        if a.prompt_logprobs is not None:
            for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                for k in pa:
                    assert abs(pa[k].logprob - pb[k].logprob) <= tol


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_llama_with_biases(make_llm, tiny_llama_dir, tp, pp):
    ref = _run(make_llm(tiny_llama_dir), prompt_logprobs=2)
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert type(llm.llm_engine.core.executor).__name__ == "MultiprocExecutor"
    _assert_same(ref, _run(llm, prompt_logprobs=2))


def test_tied_qwen2_padded_vocab_uneven_stages(make_llm, tiny_qwen2_tied_dir):
    ref = _run(make_llm(tiny_qwen2_tied_dir))
    _assert_same(ref, _run(make_llm(tiny_qwen2_tied_dir, tensor_parallel_size=2, pipeline_parallel_size=2)))


def test_chunked_prefill_prefix_caching_preemption_tp2(make_llm, tiny_llama_dir):
    """A 32-token budget chunks the prompts; a shared prefix hits the cache; a KV cache of a
    few blocks preempts. TP=2 gives the TP=1 outputs."""
    shared = [1] + [(11 * i) % 250 + 3 for i in range(64)]
    prompts = [{"prompt_token_ids": shared + [5 + i, 9, 13]} for i in range(6)]
    kw = dict(max_num_batched_tokens=32, block_size=8, enable_prefix_caching=True, max_model_len=128)
    one = make_llm(tiny_llama_dir, kv_cache_memory=_blocks_bytes(24, 1), **kw)
    ref = _run(one, prompts, max_tokens=40)
    assert one.llm_engine.core.scheduler.num_preemptions_total > 0
    two = make_llm(tiny_llama_dir, tensor_parallel_size=2, kv_cache_memory=_blocks_bytes(24, 2), **kw)
    assert two.llm_engine.core.num_blocks == one.llm_engine.core.num_blocks
    got = _run(two, prompts, max_tokens=40)
    assert two.llm_engine.core.scheduler.num_preemptions_total > 0
    assert two.llm_engine.core.scheduler.prefix_cache_hits > 0
    _assert_same(ref, got)


def _blocks_bytes(blocks: int, tp: int) -> int:
    """KV bytes holding ``blocks`` blocks of 8 tokens of the tiny Llama (4 layers, 2 KV heads,
    head_dim 16, fp32) on one of ``tp`` ranks."""
    return blocks * 8 * 2 * 4 * (2 // tp) * 16 * 4


def test_quantized_shards_run(make_llm, tiny_llama_dir):
    """int8 / w8a8 shards load and generate (quantized per rank slice: values differ slightly
    from one rank's, so only the run and the output length are checked on this random model;
    SmolLM2's greedy agreement is in test_real_parallel.py)."""
    for q in ("int8", "w8a8"):
        out = _run(make_llm(tiny_llama_dir, tensor_parallel_size=2, quantization=q), max_tokens=6)
        assert all(len(o.outputs[0].token_ids) == 6 for o in out)


def test_bad_head_split_is_a_clear_error(make_llm, tiny_qwen2_tied_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(tiny_qwen2_tied_dir, tensor_parallel_size=4)
