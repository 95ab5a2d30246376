"""The transformers fallback (models/transformers_backend.py). Its logit and greedy parity on two
architectures pagedllm has no native implementation of (Cohere: logit scale, LayerNorm, parallel
attention/MLP; Starcoder2: sliding window, biases, gelu MLP) is in test_architectures.py
(``FALLBACK_CASES``); here: the selection rules of ``--model-impl``, the fallback on a native
architecture (same tokens as native), dummy weights, and what it refuses."""
from __future__ import annotations

import pytest
import torch
from arch_cases import CASES, FALLBACK_CASES, PROMPTS, make_checkpoint
from test_architectures import Runner, hf_logits, load_ours

from pagedllm import LLM, SamplingParams
from pagedllm.models.registry import MODEL_REGISTRY, get_model_class
from pagedllm.models.transformers_backend import TransformersForCausalLM

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _greedy(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                         o.outputs[0].token_ids)]) for o in outs]


def test_model_impl_selection():
    cohere = CASES["cohere"][1]()
    cohere.architectures = ["CohereForCausalLM"]
    assert all(CASES[c][0] not in MODEL_REGISTRY for c in FALLBACK_CASES)
    assert get_model_class(cohere.architectures, "auto", cohere) is TransformersForCausalLM
    with pytest.raises(ValueError, match=r"unsupported model architectures \['CohereForCausalLM'\].*LlamaForCausalLM"):
        get_model_class(cohere.architectures, "pagedllm", cohere)
    llama = CASES["llama"][1]()
    assert get_model_class(["LlamaForCausalLM"], "auto", llama).__name__ == "LlamaForCausalLM"
    assert get_model_class(["LlamaForCausalLM"], "transformers", llama) is TransformersForCausalLM
    with pytest.raises(ValueError, match="model_impl"):
        get_model_class(["LlamaForCausalLM"], "vllm", llama)


@pytest.mark.parametrize("case", ["llama", "mixtral"])
def test_fallback_on_a_native_architecture_matches_native(case, tmp_path):
    """``model_impl="transformers"`` on Llama / Mixtral (per-expert Hub checkpoint names, converted by
    transformers): the same greedy tokens and logprobs (1e-4) as the native model through LLM."""
    hf = make_checkpoint(case, str(tmp_path))
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=8, kv_cache_memory=2 * 1024**2)
    native = LLM(str(tmp_path), **kw)
    fallback = LLM(str(tmp_path), model_impl="transformers", **kw)
    assert isinstance(fallback.llm_engine.core.model, TransformersForCausalLM)
    for (ta, la), (tb, lb) in zip(_greedy(native), _greedy(fallback)):
        assert ta == tb and la == pytest.approx(lb, abs=1e-4)
    ours = load_ours(str(tmp_path), "transformers")
    torch.testing.assert_close(Runner(ours).step([("a", PROMPTS[0])]), hf_logits(hf, PROMPTS[0]),
                               atol=1e-4, rtol=1e-4)


def test_fallback_dummy_weights(tmp_path):
    make_checkpoint("cohere", str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", load_format="dummy", kv_cache_memory=2 * 1024**2)
    w = llm.llm_engine.core.model.hf.model.layers[0].mlp.down_proj.weight
    assert w.device.type == "cpu" and 0 < w.abs().max() <= 1e-3
    assert len(_greedy(llm)[0][0]) == 12


def test_fallback_refuses_per_layer_kv_shapes():
    """Gemma 4's full-attention layers use a larger head_dim than its sliding ones: one cache shape per
    layer does not fit them, and the fallback says so instead of producing garbage."""
    import transformers as tf

    cfg = tf.Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                              hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
                              layer_types=["sliding_attention", "full_attention"])
    cfg.architectures = ["Gemma4ForCausalLM"]
    with pytest.raises(ValueError, match="per-layer KV shapes are not supported"):
        TransformersForCausalLM(cfg, torch.float32)
