"""End-to-end greedy generation on the real models vs the transformers reference (fp32).

Greedy decoding is compared token for token: both sides run float32 on the same
dequantized weights, so their logits agree to ~1e-4 (see tests/models) and argmax ties are
not expected on these prompts.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


#: like with like against dequantized float32 references (tests/conftest.py _gguf_float_activations)
GGUF_FLOAT_ACTIVATIONS = True


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is about a young wizard who",
    "To make a cup of tea, first",
    "The quick brown fox",
]
N_OUT = 32


def _hf_greedy(model, tok, prompts, n_out):
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            g = model.generate(ids, max_new_tokens=n_out, do_sample=False,
                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            refs.append(g[0, ids.shape[1]:].tolist())
    return refs


@pytest.fixture(scope="module")
def smollm2_refs(hf_smollm2):
    model, tok = hf_smollm2
    return _hf_greedy(model, tok, PROMPTS, N_OUT)


def test_smollm2_greedy_batch_equals_reference(smollm2_llm, smollm2_refs):
    outs = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_OUT), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for o, ref in zip(outs, smollm2_refs):
        assert o.outputs[0].token_ids == ref, o.prompt
        assert o.outputs[0].finish_reason in ("stop", "length")
        assert o.outputs[0].text == smollm2_llm.get_tokenizer().decode(ref, skip_special_tokens=True)


def test_smollm2_chunked_prefill_and_preemption(smollm2_refs):
    # Token budget (8) smaller than every prompt: prefill runs in chunks beside decodes; and a KV cache of
    # 12 blocks x 16 tokens for 8 requests of up to ~50 tokens forces preemption.
    bytes_per_block = 2 * 30 * 3 * 64 * 4 * 16
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", max_num_batched_tokens=8, max_model_len=128,
              kv_cache_memory=12 * bytes_per_block, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_OUT), use_tqdm=False)
    for o, ref in zip(outs, smollm2_refs):
        assert o.outputs[0].token_ids == ref, o.prompt
    assert llm.llm_engine.core.scheduler.num_preemptions_total > 0
    # Every block is back in the pool once all requests are done.
    assert llm.llm_engine.core.kv_cache_manager.usage == 0


def test_smollm2_chat_is_coherent(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    text = out[0].outputs[0].text
    assert "Paris" in text
    assert out[0].outputs[0].finish_reason == "stop"


def test_smollm2_chat_developer_role_is_system(smollm2_llm):
    """SmolLM2's template has no ``developer`` role: LLM.chat renders it as ``system`` (else the
    template adds its default system prompt and an unknown turn: 40 prompt tokens, not 18)."""
    def chat(role):
        msgs = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        return smollm2_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    dev, sys_ = chat("developer"), chat("system")
    assert dev.prompt_token_ids == sys_.prompt_token_ids and len(dev.prompt_token_ids) == 18
    assert dev.outputs[0].token_ids == sys_.outputs[0].token_ids


def test_bad_input_then_engine_still_serves(smollm2_llm, smollm2_refs):
    llm = smollm2_llm
    sp = SamplingParams(temperature=0, max_tokens=N_OUT)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", sp, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * (llm.llm_engine.max_model_len + 1)}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1, 2, 10**7]}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1, -3]}, sp, use_tqdm=False)
    # One bad prompt in a list rejects the whole call and adds nothing.
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], ""], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids == smollm2_refs[0]


def test_unknown_model_error_lists_what_is_available():
    with pytest.raises(ValueError) as ei:
        LLM("no-such-model-xyz")
    msg = str(ei.value)
    assert "no-such-model-xyz" in msg and "SmolLM2-135M-Instruct" in msg


def test_gemma3_greedy_batch_equals_reference(gemma3_path, hf_gemma3):
    model, tok = hf_gemma3
    prompts = PROMPTS[:4] + ["Question: What is the capital of France?\nAnswer:"]
    refs = _hf_greedy(model, tok, prompts, 24)
    llm = LLM(gemma3_path, dtype="float32", kv_cache_memory=128 * 1024**2, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for o, ref in zip(outs, refs):
        assert o.outputs[0].token_ids == ref, o.prompt
    assert "Paris" in outs[-1].outputs[0].text


def test_wrong_argument_types_are_type_errors_naming_them(smollm2_llm):
    """generate() with something other than SamplingParams, or a prompt that is not a prompt,
    raises a TypeError naming the argument (not an AttributeError from inside), and the LLM keeps
    working; vLLM's LLMEngine.get_num_unfinished_requests / get_tokenizer are there."""
    with pytest.raises(TypeError, match="sampling_params: expected a SamplingParams"):
        smollm2_llm.generate(["1 2 3"], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        smollm2_llm.generate(["x"], 5, use_tqdm=False)
    for bad in (None, 5):
        with pytest.raises(TypeError, match="prompts: expected"):
            smollm2_llm.generate(bad, use_tqdm=False)
    eng = smollm2_llm.llm_engine
    assert eng.get_num_unfinished_requests() == 0 and eng.get_tokenizer() is smollm2_llm.get_tokenizer()
    out = smollm2_llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_model_config_view_has_vllms_names(smollm2_llm):
    """``llm.llm_engine.model_config`` (vLLM's ``ModelConfig`` names) states the loaded model:
    SmolLM2-135M's published shape, the resolved dtype and context, and is read-only."""
    import dataclasses

    import torch
    mc = smollm2_llm.llm_engine.model_config
    assert mc.model == "SmolLM2-135M-Instruct" and mc.served_model_name == "SmolLM2-135M-Instruct"
    assert mc.dtype == torch.float32 and mc.quantization == "none" and mc.seed == 0
    assert mc.runner_type == "generate" and mc.max_logprobs == 20
    assert mc.max_model_len == smollm2_llm.llm_engine.max_model_len > 0
    # SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, vocabulary 49,152
    assert (mc.get_num_layers(), mc.get_hidden_size(), mc.get_vocab_size()) == (30, 576, 49152)
    assert (mc.get_num_attention_heads(), mc.get_num_kv_heads(), mc.get_head_size()) == (9, 3, 64)
    assert mc.hf_config.architectures == ["LlamaForCausalLM"] and mc.hf_text_config is mc.hf_config
    assert not mc.is_multimodal_model and mc.get_sliding_window() is None
    assert smollm2_llm.llm_engine.get_model_config() is mc
    with pytest.raises(dataclasses.FrozenInstanceError):
        mc.max_model_len = 1  # type: ignore[misc]
