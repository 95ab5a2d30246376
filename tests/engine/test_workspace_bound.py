"""The per-step workspace is bounded by the prefill chunk (``max_num_batched_tokens``), not by the
prompt (issue 30.4): a prompt 2.5x longer than another, both longer than one chunk, leaves the CPU
allocator's cache (which keeps a step's freed temporaries of 1 MiB and more, so after a step it holds
that step's peak workspace) no larger, beyond what the torch attention path (CPUs without
AVX512-BF16, float32 models) needs per context token: the gathered K/V, SDPA's K/V widened to the
query heads, and ``PREFILL_Q_BLOCK`` rows of mask; ``max_model_len`` bounds those. Measured here
(SmolLM2, 512-token chunks, 1,024 vs 4,096 tokens): bf16 kernel path 14.4 vs 14.4 MiB; float32
torch path 42.0 vs 56.3 MiB (70.5 MiB before the query blocks). The test runs 384-token chunks."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_paged import PREFILL_Q_BLOCK
from pagedllm.kernels.cpu_ops import cpu_allocator_empty_cache, cpu_allocator_stats

MiB = 1 << 20


@pytest.mark.slow
def test_long_prompt_does_not_grow_the_workspace(smollm2_path):
    # Prompts of 2 and 5 chunks (768 and 1,920 tokens: 35 s on a Zen 1; 2 and 6 chunks of 512 took 64 s). A
    # chunk stays above WORKSPACE_BIG_STEP_TOKENS, so that its step counts as prefill for the trimmer.
    chunk, k = 384, 5
    llm = LLM(smollm2_path, kv_cache_memory=256 * MiB, max_model_len=(k + 1) * chunk, max_num_batched_tokens=chunk,
              enable_prefix_caching=False)
    if not cpu_allocator_stats():
        pytest.skip("the caching CPU allocator is not installed (PAGEDLLM_CPU_ALLOCATOR=0 or no C++ kernels)")
    cfg = llm.llm_engine.core.hf_config
    sp = SamplingParams(temperature=0, max_tokens=1)
    cached = {}
    for n in (2 * chunk, k * chunk):
        ids = [(i * 7919) % 40000 + 100 for i in range(n)]
        cpu_allocator_empty_cache()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        assert len(out[0].prompt_token_ids) == n
        cached[n] = cpu_allocator_stats()["cached_bytes"]
    assert cached[2 * chunk] > 0  # the chunk's temporaries went through the cache
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    longer = (k - 2) * chunk  # extra context tokens of the longer prompt
    heads = cfg.num_attention_heads + cfg.num_key_value_heads
    context_part = longer * (2 * heads * head_dim * 4 + PREFILL_Q_BLOCK * 5)
    assert cached[k * chunk] <= cached[2 * chunk] + context_part + 4 * MiB, cached
    # Once decode-only steps follow, the chunk's workspace is given back (issue 30.4,
    # ``WorkspaceTrimmer``): trimmed once, to at most WORKSPACE_KEEP_BYTES plus what the later
    # decode steps freed.
    from pagedllm.metrics.memory import WORKSPACE_KEEP_BYTES

    trimmer = llm.llm_engine.core.executor.driver_worker.workspace_trimmer
    trims = trimmer.trims
    ids = [(i * 7919) % 40000 + 100 for i in range(k * chunk)]
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert trimmer.trims == trims + 1 and not trimmer.dirty
    assert cpu_allocator_stats()["cached_bytes"] <= WORKSPACE_KEEP_BYTES + 4 * MiB
