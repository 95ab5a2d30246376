"""GGUF files of the new architectures: the tiny transformers checkpoints of ``tests/arch_cases.py`` written
as llama.cpp's ``convert_hf_to_gguf.py`` writes them (its metadata keys and tensor names, q/k permuted for
llama / granite, Gemma norms stored as ``1 + w``, Phi-3's fused tensors and longrope factor tensors, MoE
experts stacked as ``ffn_*_exps``) with gguf-py, then loaded by pagedllm: logits within 1e-4 of the
transformers model they came from (F32), close with Q8_0, greedy tokens through ``LLM``; and where
transformers itself loads such GGUFs (Gemma 2, Phi-3, Qwen2-MoE, Qwen3-MoE) its config and logits from
the same file agree with ours, which checks the writer's conventions independently."""
from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import torch
from arch_cases import CASES, PROMPTS, build_hf, hf_greedy, tiny_tokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata
from pagedllm.loader import load_model
from pagedllm.models.registry import get_model_class

torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"gemma2": "gemma2", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2", "mixtral": "llama",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
TRANSFORMERS_READS = ("gemma2", "phi3", "qwen2_moe", "qwen3_moe")
PROMPT = [5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 2]
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "post_attention_layernorm": "ffn_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def _permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf, case: str) -> dict[str, np.ndarray]:
    c, arch = hf.config, GGUF_ARCH[case]
    out = {}
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
            continue
        if name == "model.norm.weight":
            out["output_norm.weight"] = a + (1 if case == "gemma2" else 0)
            continue
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = a
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name) or re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        blk, part = f"blk.{m.group(1)}", m.group(2)
        if part == "mlp.experts.gate_up_proj":
            n = a.shape[1] // 2
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = a[:, :n].copy(), a[:, n:].copy()
            continue
        if part == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = a
            continue
        kind = "bias" if name.endswith(".bias") else "weight"
        part = part.removesuffix(".bias")
        key = _LAYER[part]
        if case in ("gemma2", "olmo2") and part == "post_attention_layernorm":
            key = "post_attention_norm"
        if arch in ("llama", "granite") and part in ("self_attn.q_proj", "self_attn.k_proj"):
            a = _permute(a, c.num_attention_heads if part.endswith("q_proj") else c.num_key_value_heads)
        if case == "gemma2" and part.endswith("norm"):
            a = a + 1
        if key == "ffn_gate_inp_shexp":
            a = a.reshape(-1)
        out[f"{blk}.{key}.{kind}"] = a
    return out


def write_gguf(hf, case: str, path: str, qtype=Q.F32) -> str:
    """``hf`` (a tiny ``CASES[case]`` model) as a GGUF file in llama.cpp's layout; 2-D weights in ``qtype``."""
    from gguf.quants import quantize

    c, arch = hf.config, GGUF_ARCH[case]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{case}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch in ("llama", "granite"):
        w.add_rope_dimension_count(head_dim)
    elif arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma2":
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if hasattr(c, "num_experts_per_tok"):
        w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "olmoe" and c.clip_qkv:
        w.add_clamp_kqv(c.clip_qkv)
    tensors = _gguf_tensors(hf, case)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, c.vocab_size)]
    w.add_tokenizer_model("llama")  # NOTE: transformers' GGUF reader wants a vocabulary
    w.add_token_list(words)
    w.add_token_scores([0.0] * len(words))
    w.add_token_types([3, 3, 3] + [1] * (len(words) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for name, arr in tensors.items():
        qt = qtype if arr.ndim >= 2 and arr.shape[-1] % 32 == 0 and "token_embd" not in name else Q.F32
        w.add_tensor(name, arr if qt == Q.F32 else quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _our_logits(model, ids):
    n_layers, hkv, d = model.get_kv_cache_spec()
    caches = [torch.zeros(8, 2, 4, hkv, d) for _ in range(n_layers)]
    ctx = ForwardContext(build_metadata([(0, len(ids), [7, 5, 3, 1])], 4), caches, TorchPagedAttention())
    with torch.no_grad(), set_forward_context(ctx):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def _load(path, **kw):
    tok = os.path.join(os.path.dirname(path), "tok")
    if not os.path.isdir(tok):
        tiny_tokenizer().save_pretrained(tok)
    lm = load_model(path, tokenizer=tok, **kw)
    model = get_model_class(lm.hf_config.architectures, "pagedllm")(lm.hf_config, torch.float32)
    model.load_weights(lm.weights())
    return lm, model.eval()


_HF: dict = {}
# What llama.cpp's GGUF cannot express is set the way its runtime behaves: Gemma 2's query scale is
# 1/sqrt(head_dim); Mixtral's (llama) metadata has no sliding window.
_GGUF_CONFIG = {"gemma2": {"query_pre_attn_scalar": 32}, "mixtral": {"sliding_window": None}}


def _hf(case, **overrides):
    key = (case, repr(sorted(overrides.items())))
    if key not in _HF:
        config = CASES[case][1]()
        for k, v in {**_GGUF_CONFIG.get(case, {}), **overrides}.items():
            setattr(config, k, v)
        _HF[key] = build_hf(config, CASES[case][0])
    return _HF[key]


@pytest.mark.parametrize("case", list(GGUF_ARCH))
def test_gguf_logits_match_transformers(case, tmp_path):
    hf = _hf(case)
    path = write_gguf(hf, case, str(tmp_path / f"{case}.gguf"))
    lm, ours = _load(path)
    assert lm.hf_config.architectures == [CASES[case][0]] and lm.load_format == "gguf"
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_our_logits(ours, PROMPT), ref, atol=1e-4, rtol=1e-4)
    # Q8_0 (experts' 3-D tensors too): every weight is gguf-py's dequantization of what was written
    from gguf.quants import dequantize, quantize

    q8 = write_gguf(hf, case, str(tmp_path / f"{case}-q8.gguf"), Q.Q8_0)
    got = dict(_load(q8)[0].weights())
    want = dict(lm.weights())
    assert got.keys() == want.keys()
    n_quantized = 0
    for name, t in want.items():
        if (t.dim() >= 2 and t.shape[-1] % 32 == 0 and "embed_tokens" not in name and "norm" not in name
                and "shared_expert_gate" not in name):  # NOTE: written as a 1-D (F32) tensor, as llama.cpp does
            ref_q = torch.from_numpy(dequantize(quantize(t.numpy(), Q.Q8_0), Q.Q8_0).reshape(t.shape))
            assert torch.equal(got[name], ref_q), name
            n_quantized += 1
        else:
            assert torch.equal(got[name], t), name
    assert n_quantized >= 8


@pytest.mark.parametrize("case", list(GGUF_ARCH))
def test_gguf_greedy_through_llm(case, tmp_path):
    """3 prompts x 16 greedy tokens through ``LLM`` on the GGUF (8-token chunks, prefix caching on: the
    later prompts share the first prompt's cached blocks) equal transformers' ``generate``."""
    hf = _hf(case)
    path = write_gguf(hf, case, str(tmp_path / f"{case}.gguf"))
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    llm = LLM(path, tokenizer=str(tmp_path / "tok"), dtype="float32", block_size=4, max_num_batched_tokens=8,
              kv_cache_memory=2 * 1024**2, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts[:1], sp, use_tqdm=False) + llm.generate(prompts, sp, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.prefix_cache_hits > 0
    for ids, out in zip(PROMPTS[:1] + PROMPTS, outs):
        toks, logps = hf_greedy(hf, ids)
        got = out.outputs[0]
        assert list(got.token_ids) == toks
        assert [lp[t].logprob for lp, t in zip(got.logprobs, toks)] == pytest.approx(logps, abs=1e-4)


def test_batch_invariant_mode_on_a_quantized_gguf(tmp_path):
    """A quantized GGUF under ``batch_invariant=True`` keeps its int8/int4 group-32 blocks on the
    integer-dot kernel when that is on (``PAGEDLLM_GGUF_INTDOT=1``; else it loads dequantized) (batch invariant by construction: fixed-order integer sums, per-row
    activation scales), so a prompt's logprobs are the same bits alone and in a batch; with
    ``quantization="none"`` it loads dequantized onto the float batch-invariant GEMMs, likewise.
    Failed once: the invariant linears read the quantized layer's empty float weight."""
    hf = _hf("granite")
    path = write_gguf(hf, "granite", str(tmp_path / "q8.gguf"), Q.Q8_0)
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm, ps):
        return [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
                for o in llm.generate(ps, sp, use_tqdm=False)]

    for quantization in (None, "none"):
        llm = LLM(path, tokenizer=str(tmp_path / "tok"), dtype="float32", block_size=4, kv_cache_memory=2 * 1024**2,
                  batch_invariant=True, quantization=quantization)
        qc = llm.llm_engine.core.loaded.quant_config
        from pagedllm.quantization import group_quant as gq
        # blocks kept only on the integer-dot kernel (PAGEDLLM_GGUF_INTDOT=1); else dequantized
        assert (qc is not None) == (quantization is None and gq.INTDOT), qc
        batched = run(llm, prompts)
        alone = [run(llm, [p])[0] for p in prompts]
        assert batched == alone
        assert all(len(toks) == 8 for toks, _ in batched)
        del llm


@pytest.mark.parametrize("case", TRANSFORMERS_READS)
def test_transformers_reads_the_same_gguf(case, tmp_path):
    """transformers' own GGUF loader on our file: same config fields and logits as ours (an independent
    reading of llama.cpp's conventions)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # NOTE: transformers' GGUF reader maps a dense layer of a Qwen2-MoE (mlp_only_layers) wrongly; real
    # checkpoints have none, so its cross-check uses an all-sparse model (ours reads both: the test above).
    hf = _hf(case, mlp_only_layers=[]) if case == "qwen2_moe" else _hf(case)
    path = write_gguf(hf, case, str(tmp_path / f"{case}.gguf"))
    ref_cfg = AutoConfig.from_pretrained(str(tmp_path), gguf_file=f"{case}.gguf")
    lm, ours = _load(path)
    # NOTE: transformers' GGUF reader leaves some fields at their defaults (Gemma 2's soft-caps, the MoE
    # expert sizes); those are compared through the logits below, with our config.
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                  "num_experts", "num_experts_per_tok", "sliding_window", "head_dim", "norm_topk_prob"):
        if hasattr(ref_cfg, field) and field in ref_cfg.to_dict():
            assert getattr(lm.hf_config, field) == getattr(ref_cfg, field), field
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{case}.gguf", dtype=torch.float32,
                                                  config=lm.hf_config).eval()
    with torch.no_grad():
        ref = theirs(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_our_logits(ours, PROMPT), ref, atol=1e-4, rtol=1e-4)
