"""The fused C++ decode step is a runner-level accelerator (``worker.fused_decode``): model files
carry no hook for it; ``build_decode_accelerator`` decides once, after the model is finished,
whether it runs and logs why; the engine's runner holds the result."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.kernels.cpu_ops import get_ops
from pagedllm.worker.fused_decode import FusedDecode, build_decode_accelerator

_OPS = get_ops()
pytestmark = pytest.mark.skipif(_OPS is None or not hasattr(_OPS, "llama_decode_dense"),
                                reason="needs the C++ kernels with the fused dense decode step")


def test_models_hold_no_fast_path():
    from pagedllm.models.llama import LlamaModel

    assert not any(hasattr(LlamaModel, a) for a in ("fused_decode_builder", "_fused_decode", "disable_fused_decode"))


def test_eligibility_is_decided_once_and_logged(tiny_llama, caplog):
    model = tiny_llama(True)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        plan = build_decode_accelerator(model)
        assert isinstance(plan, FusedDecode) and plan.kind == "dense"
        assert build_decode_accelerator(model, sharded=True) is None
        assert build_decode_accelerator(model, batch_invariant=True) is None
        handle = model.model.layers[1].register_forward_pre_hook(lambda m, a: None)
        assert build_decode_accelerator(model, name="target") is None
        handle.remove()
    msgs = [r.getMessage() for r in caplog.records if "fused CPU decode step" in r.getMessage()]
    assert msgs == ["pagedllm: model: fused CPU decode step on (dense)",
                    "pagedllm: model: fused CPU decode step off (tensor/pipeline parallel)",
                    "pagedllm: model: fused CPU decode step off (batch-invariant mode)",
                    "pagedllm: target: fused CPU decode step off (hooks on the decoder layers read hidden states)"]


def test_the_engine_runner_holds_it(tmp_path, smollm2_path, monkeypatch):
    import transformers as tf

    from pagedllm import LLM, SamplingParams
    from pagedllm.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", flag)
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=8 * 1024**2, max_model_len=128)
        acc = llm.llm_engine.core.runner.decode_accelerator
        assert isinstance(acc, FusedDecode) if flag == "1" else acc is None
        out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        outs.append((out.token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in out.logprobs]))
    assert outs[0] == outs[1]
