"""Gemma 4 text target (``pagedllm/models/gemma4.py``) on a tiny random ``Gemma4ForCausalLM``
saved with ``save_pretrained`` (per-layer head shapes, k = v full layers, KV sharing, per-layer
embeddings, proportional rope, soft-cap: ``spec_helpers.tiny_gemma4_config``):

- logits of a paged prefill and of chunked prefill + decode equal transformers' (float32 tolerance);
- through ``LLM``: greedy tokens equal ``generate`` and the returned logprobs equal transformers';
- one completion through ``pagedllm serve``;
- the MTP drafter (random, ``gemma4_assistant`` layout) on this target: greedy outputs identical
  to the non-speculative engine's, drafts made;
- unsupported configs (MoE, bidirectional) refused naming the field."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_helpers import serve

from pagedllm import LLM, SamplingParams

from spec_helpers import _save_head, mtp_head_weights, tiny_gemma4_config, tiny_prompts, write_tiny_gemma4

KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


@pytest.fixture(scope="module")
def g4_dir(tmp_path_factory) -> str:
    return write_tiny_gemma4(str(tmp_path_factory.mktemp("g4") / "gemma4"))


@pytest.fixture(scope="module")
def hf_g4(g4_dir):
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM.from_pretrained(g4_dir, attn_implementation="eager").float().eval()


def _ours(g4_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pagedllm.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(g4_dir)
    model = get_model_class(cfg.architectures)(cfg, torch.float32)
    model.load_weights(load_file(f"{g4_dir}/model.safetensors").items())
    return model.eval()


def _step(model, caches, reqs, ids, pos):
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

    meta = build_metadata(reqs, 4)
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, caches, TorchPagedAttention())):
        return model.compute_logits(model(torch.tensor(ids), torch.tensor(pos)))


def test_logits_match_transformers_prefill_chunked_and_decode(g4_dir, hf_g4):
    model = _ours(g4_dir)
    layers, hkv, d = model.get_kv_cache_spec()
    assert (layers, hkv, d) == (4, 2, 32)  # two KV-sharing layers own no cache; the full layers' D
    ids = torch.randint(3, 128, (26,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf_g4(torch.tensor([ids])).logits[0]
    blocks = list(range(1, 8))
    caches = [torch.zeros(9, 2, 4, hkv, d) for _ in range(layers)]
    full = _step(model, caches, [(0, 26, blocks)], ids, list(range(26)))
    torch.testing.assert_close(full, ref, atol=2e-4, rtol=1e-4)
    # chunked prefill (10 + 9) then seven one-token decodes into a fresh cache
    caches = [torch.zeros(9, 2, 4, hkv, d) for _ in range(layers)]
    out = [_step(model, caches, [(0, 10, blocks)], ids[:10], list(range(10))),
           _step(model, caches, [(10, 9, blocks)], ids[10:19], list(range(10, 19)))]
    for p in range(19, 26):
        out.append(_step(model, caches, [(p, 1, blocks)], ids[p:p + 1], [p]))
    torch.testing.assert_close(torch.cat(out), ref, atol=2e-4, rtol=1e-4)


def test_conditional_generation_checkpoint_text_decoder(tmp_path):
    """A text-only ``Gemma4ForConditionalGeneration`` checkpoint (``model.language_model.*``, tied
    head): the same logits as transformers."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=tiny_gemma4_config().to_dict(), vision_config=None, audio_config=None)
    hf = Gemma4ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.normal_(0, 1.0 if "embed" in n else 0.1) if p.dim() > 1 else p.normal_(1.0, 0.2)
    hf.save_pretrained(str(tmp_path / "mm"))
    model = _ours(str(tmp_path / "mm"))
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    layers, hkv, d = model.get_kv_cache_spec()
    got = _step(model, [torch.zeros(7, 2, 4, hkv, d) for _ in range(layers)], [(0, 20, list(range(1, 6)))], ids,
                list(range(20)))
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_llm_greedy_and_logprobs_equal_transformers(g4_dir, hf_g4):
    llm = LLM(g4_dir, **KW)
    prompts = [p["prompt_token_ids"] for p in tiny_prompts(3, seed=5)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            seq = hf_g4.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0]
            ref_lp = torch.log_softmax(hf_g4(seq[None]).logits[0].float(), -1)
        got = list(o.outputs[0].token_ids)
        assert got == seq[len(p):].tolist()
        for j, (tok, lps) in enumerate(zip(got, o.outputs[0].logprobs)):
            assert abs(lps[tok].logprob - float(ref_lp[len(p) - 1 + j, tok])) < 1e-3


def test_serve_one_completion(g4_dir):
    prompt = "w5 w9 w11 w5 w9 w11 w5"
    ref = LLM(g4_dir, **KW).generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0].text
    with serve([g4_dir, "--dtype", "float32", "--max-model-len", "256", "--disable-log-stats"]) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"model": g4_dir, "prompt": prompt, "max_tokens": 12,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref


def _gemma4_mtp_head(d: str, target_dir: str) -> str:
    """A random assistant with a sliding and a full layer, sized to the target's (padded) cache."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(target_dir)
    text = {"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"], "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": tc.vocab_size, "rms_norm_eps": 1e-6,
            "sliding_window": tc.sliding_window, "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
    cfg = {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"],
           "backbone_hidden_size": tc.hidden_size, "text_config": text, "tie_word_embeddings": True,
           "use_ordered_embeddings": False}
    return _save_head(d, mtp_head_weights(cfg, seed=3), cfg)


def test_mtp_on_gemma4_target_is_lossless(g4_dir, tmp_path):
    head = _gemma4_mtp_head(str(tmp_path / "g4_mtp"), g4_dir)
    prompts = tiny_prompts(6, seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(g4_dir, **KW).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(g4_dir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": 3,
                                          "disable_by_batch_size": 0}, **KW)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts
    # the drafter reads the target's last non-shared sliding (3) and full (2) layers' caches
    from transformers import AutoConfig

    from pagedllm.spec_decode.mtp import default_mtp_kv_layers
    tc = AutoConfig.from_pretrained(g4_dir)
    assert default_mtp_kv_layers(tc.layer_types, ["sliding_attention", "full_attention"],
                                 tc.num_kv_shared_layers) == [3, 2]


@pytest.mark.parametrize("field,over", [("enable_moe_block", dict(enable_moe_block=True, num_experts=2,
                                                                   top_k_experts=1, moe_intermediate_size=8)),
                                        ("use_bidirectional_attention", dict(use_bidirectional_attention="all"))])
def test_unsupported_config_refused_naming_the_field(field, over):
    from pagedllm.models.gemma4 import Gemma4ForCausalLM

    with pytest.raises(ValueError, match=field):
        Gemma4ForCausalLM(tiny_gemma4_config(**over))


def test_target_config_json_is_gemma4_text(g4_dir):
    with open(f"{g4_dir}/config.json") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "gemma4_text" and cfg["architectures"] == ["Gemma4ForCausalLM"]
    assert cfg["num_kv_shared_layers"] == 2 and cfg["attention_k_eq_v"] and cfg["hidden_size_per_layer_input"] == 8
