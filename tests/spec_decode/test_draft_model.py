"""Draft-model proposer on tiny random checkpoints: the target's own weights as the draft
accept (nearly) every draft (the draft's KV cache shares the target's block tables and stays
in step), an unrelated draft and an int4 self-draft keep greedy outputs exact (alone, batched,
chunked prefill, preemption), and the draft's KV bytes count in the cache budget."""
import pytest

from pagedllm import LLM, SamplingParams

from spec_helpers import tiny_prompts, write_tiny_llama

KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("spec_draft") / "llama1"), seed=1, layers=1)


def cfg(model, k=3, **extra):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "disable_by_batch_size": 0, **extra}


def gen(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    base = LLM(tiny_llama_dir, **KW)
    prompts = tiny_prompts(12, seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return prompts, sp, gen(base, prompts, sp)


def test_identical_draft_accepts_everything(tiny_llama_dir, reference):
    prompts, sp, ref = reference
    llm = LLM(tiny_llama_dir, speculative_config=cfg(tiny_llama_dir, k=4), **KW)
    assert gen(llm, prompts, sp) == ref
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_draft_tokens > 200
    assert st.acceptance_rate > 0.95, st


@pytest.mark.parametrize("draft", ["other", "int4-self"])
def test_greedy_equal(tiny_llama_dir, other_draft_dir, reference, draft):
    prompts, sp, ref = reference
    spec = cfg(other_draft_dir) if draft == "other" else cfg(tiny_llama_dir, quantization="int4")
    llm = LLM(tiny_llama_dir, speculative_config=spec, **KW)
    assert [gen(llm, [p], sp)[0] for p in prompts[:4]] == ref[:4]  # alone
    assert gen(llm, prompts, sp) == ref  # batched
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0


def test_chunked_prefill_and_preemption(tiny_llama_dir, reference):
    prompts, sp, ref = reference
    # Target 2 layers + draft 2 layers: 1 KiB per token; 48 blocks of 4 tokens cannot hold 12
    # requests of ~90 tokens: preemption; a 16-token budget chunks the prompts.
    kw = dict(KW, max_num_batched_tokens=16, block_size=4, kv_cache_memory=48 * 4 * 1024, max_model_len=128)
    llm = LLM(tiny_llama_dir, speculative_config=cfg(tiny_llama_dir, k=3), **kw)
    core = llm.llm_engine.core
    assert core.num_blocks == 48  # the draft's KV bytes are in the budget
    assert gen(llm, prompts, sp) == ref
    assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.spec_stats.acceptance_rate > 0.9


def test_vocab_mismatch_is_a_value_error(tiny_llama_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from spec_helpers import tiny_tokenizer

    d = str(tmp_path / "v64")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama_dir, speculative_config=cfg(d), **KW)


def write_eagle_head(d, seed=3):
    """A random EAGLE-1 head for the tiny target, in the published layout (config.json +
    safetensors: fc, layers.0.*)."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    Hh, nh, nkv, hd, inter = 64, 4, 2, 16, 128

    def r(*s):
        return torch.randn(*s, generator=g) * 0.1
    W = {"fc.weight": r(Hh, 2 * Hh), "layers.0.post_attention_layernorm.weight": torch.ones(Hh),
         "layers.0.self_attn.q_proj.weight": r(nh * hd, Hh), "layers.0.self_attn.k_proj.weight": r(nkv * hd, Hh),
         "layers.0.self_attn.v_proj.weight": r(nkv * hd, Hh), "layers.0.self_attn.o_proj.weight": r(Hh, nh * hd),
         "layers.0.mlp.gate_proj.weight": r(inter, Hh), "layers.0.mlp.up_proj.weight": r(inter, Hh),
         "layers.0.mlp.down_proj.weight": r(Hh, inter)}
    save_file(W, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "hidden_size": Hh,
                   "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv,
                   "head_dim": hd, "num_hidden_layers": 1, "vocab_size": 128, "rms_norm_eps": 1e-5,
                   "hidden_act": "silu", "max_position_embeddings": 512}, f)
    return d


def test_eagle_head_served_lossless(tiny_llama_dir, reference, tmp_path):
    prompts, sp, ref = reference
    head = write_eagle_head(str(tmp_path / "eagle"))
    llm = LLM(tiny_llama_dir, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3,
                                                  "disable_by_batch_size": 0},
              **dict(KW, max_num_batched_tokens=32))
    assert gen(llm, prompts, sp) == ref  # batched, chunked prefill
    assert [gen(llm, [p], sp)[0] for p in prompts[:3]] == ref[:3]
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts
    with pytest.raises(ValueError, match="backbone_hidden_size"):  # an EAGLE head is no MTP drafter
        LLM(tiny_llama_dir, speculative_config={"method": "mtp", "model": head}, **KW)


def test_eagle_head_replicating_the_target_is_accepted(tmp_path):
    """A 1-layer target whose embedding rows have unit RMS (so its input norm is the identity)
    and an EAGLE head with fc = [I | 0] and the target's layer: the head's output at position p
    is the target's residual stream at p + 1 up to the first context token, and RMSNorm with unit
    weight does not move an argmax, so nearly every draft is accepted; a wrong hidden-row or
    position offset would make acceptance collapse."""
    import json
    import os

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_helpers import init_tiny_weights, tiny_tokenizer

    d, e = str(tmp_path / "t1"), str(tmp_path / "e1")
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(c).float().eval()
    init_tiny_weights(m)
    with torch.no_grad():
        emb = m.model.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
    m.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    W = {"fc.weight": torch.cat([torch.eye(64), torch.zeros(64, 64)], 1)}
    for k, v in m.state_dict().items():
        if k.startswith("model.layers.0.") and "input_layernorm" not in k:
            W[k[len("model."):]] = v.clone().contiguous()
    os.makedirs(e)
    save_file(W, os.path.join(e, "model.safetensors"))
    with open(os.path.join(e, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 128,
                   "rms_norm_eps": 1e-6, "hidden_act": "silu"}, f)
    prompts = tiny_prompts(8, seed=9)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = gen(LLM(d, **KW), prompts, sp)
    llm = LLM(d, speculative_config={"method": "eagle", "model": e, "num_speculative_tokens": 3,
                                     "disable_by_batch_size": 0}, **KW)
    assert gen(llm, prompts, sp) == ref
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_draft_tokens > 150 and st.acceptance_rate > 0.8, st
