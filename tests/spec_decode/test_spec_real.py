"""Speculative decoding on SmolLM2-135M (slow): greedy outputs of 8 prompts x 32 tokens equal the
engine's own non-speculative outputs for every method, alone and in a batch of 16 with chunked
prefill and forced preemption; seeded sampling is reproducible; the server reports the
counters."""
import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


#: like with like against dequantized float32 references (tests/conftest.py _gguf_float_activations)
GGUF_FLOAT_ACTIVATIONS = True


TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
        "single step. All that glitters is not gold. Actions speak louder than words. ")
PROMPTS = [
    [{"role": "user", "content": "Repeat this text exactly: " + TEXT}],
    [{"role": "user", "content": "What is the capital of France? Answer in two sentences."}],
    [{"role": "user", "content": "Write a Python function that reverses a list."}],
    [{"role": "user", "content": "Copy the following list: apples, pears, plums, apples, pears, plums."}],
    [{"role": "user", "content": "Explain what a hash map is."}],
    [{"role": "user", "content": "Summarise: " + TEXT * 2}],
    [{"role": "user", "content": "List the days of the week."}],
    [{"role": "user", "content": "Tell me a short story about a robot."}],
]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_int4": {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "quantization": "int4",
                   "num_speculative_tokens": 3},
}
KW = dict(dtype="float32", kv_cache_memory=256 * 1024**2, max_num_batched_tokens=512, seed=0, max_model_len=1024)
N_OUT = 32  # drafts accepted and verified in every prompt well before this; 48 only cost time
SP = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)


def chat_ids(llm):
    return [llm.llm_engine_apply_chat_template(c) for c in PROMPTS]


@pytest.fixture(scope="module")
def baseline(smollm2_llm):
    prompts = chat_ids(smollm2_llm)
    outs = smollm2_llm.generate(prompts, SP, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equal_alone_and_in_a_batch_of_16(baseline, method):
    prompts, ref = baseline
    llm = LLM("SmolLM2-135M-Instruct", speculative_config={**METHODS[method], "disable_by_batch_size": 0}, **KW)
    # alone: half the prompts (the batch below runs all of them twice)
    alone = [llm.generate(p, SP, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[::2]]
    assert alone == ref[::2]
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_accepted_tokens > 0
    # 16 requests, a 64-token budget (chunked prefill beside verification) and a KV cache of
    # 48 blocks x 16 tokens (32 with a draft model, whose 1 + 3 verified tokens per request and
    # step leave fewer requests running at once) for 16 x ~80 tokens without prefix sharing:
    # preemption.
    kv = 33 * 16 * 46080 * 2 if "draft" in method else 49 * 16 * 46080
    small = LLM("SmolLM2-135M-Instruct", speculative_config={**METHODS[method], "disable_by_batch_size": 0},
                **{**KW, "max_num_batched_tokens": 64, "kv_cache_memory": kv,
                   "max_model_len": 384, "enable_prefix_caching": False})
    outs = small.generate(prompts + prompts, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref + ref
    assert small.llm_engine.core.scheduler.num_preemptions_total > 0


def test_seeded_sampling_reproducible_and_logprobs(baseline):
    prompts, _ = baseline
    llm = LLM("SmolLM2-135M-Instruct", speculative_config={**METHODS["ngram"], "disable_by_batch_size": 0}, **KW)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=N_OUT, logprobs=1)
    a = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0]
    b = llm.generate(prompts[:4], sp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for t, lp in zip(a.token_ids, a.logprobs):
        assert t in lp and lp[t].logprob <= 0.0
