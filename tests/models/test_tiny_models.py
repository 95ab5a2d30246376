"""Tiny random HF models vs ours on the same weights: prefill, decode, chunked prefill, batching."""

import sys

import pytest
import torch
import transformers as tf

from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata
from pagedllm.models.registry import MODEL_REGISTRY, get_model_class

torch.set_num_threads(1)
BS = 4  # block size
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)


def make_config(arch):
    if arch == "LlamaForCausalLM":
        return tf.LlamaConfig(**COMMON, num_key_value_heads=2, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    if arch == "Qwen2ForCausalLM":
        return tf.Qwen2Config(**COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    if arch == "Qwen3ForCausalLM":
        return tf.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    if arch == "Gemma3ForCausalLM":
        return tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=1, head_dim=32,
                                   sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                                   final_logit_softcapping=10.0,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise KeyError(arch)


ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"]


def make_pair(arch, strip_prefix=False):
    torch.manual_seed(0)
    config = make_config(arch)
    config._attn_implementation = "eager"
    hf = getattr(tf, arch)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # NOTE: big random weights so attention/norms really matter
            p.normal_(0, 0.15)
    ours = get_model_class([arch])(config, torch.float32)
    sd = hf.state_dict().items()
    if strip_prefix:
        sd = [(n.removeprefix("model."), t) for n, t in sd if not n.startswith("lm_head")]
    ours.load_weights(sd)
    return hf, ours


class Runner:
    """One-request-at-a-time driver with a paged cache (blocks handed out in reverse order)."""

    def __init__(self, model, num_blocks=32):
        n_layers, hkv, d = model.get_kv_cache_spec()
        self.model, self.caches = model, [torch.zeros(num_blocks, 2, BS, hkv, d) for _ in range(n_layers)]
        self.free = list(range(num_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.pos: dict[str, int] = {}

    def step(self, chunks):
        """chunks: list of (req_id, token_ids) (decodes first) -> float32 logits of every new token."""
        reqs, ids, positions = [], [], []
        for rid, toks in chunks:
            start = self.pos.get(rid, 0)
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * BS < start + len(toks):
                blocks.append(self.free.pop())
            reqs.append((start, len(toks), list(blocks)))
            ids += toks
            positions += range(start, start + len(toks))
            self.pos[rid] = start + len(toks)
        ctx = ForwardContext(build_metadata(reqs, BS), self.caches, TorchPagedAttention())
        with torch.no_grad(), set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
        return self.model.compute_logits(hidden)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


PROMPT = [5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 2]
MORE = [11, 50, 93]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_hf(arch):
    hf, ours = make_pair(arch)
    r = Runner(ours)
    logits = r.step([("a", PROMPT)])
    assert logits.dtype == torch.float32 and logits.shape == (12, 96)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)
    seq = list(PROMPT)
    for tok in MORE:
        seq.append(tok)
        out = r.step([("a", [tok])])
        torch.testing.assert_close(out[0], hf_logits(hf, seq)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_mixed_batch(arch):
    _, ours = make_pair(arch)
    one = Runner(ours).step([("a", PROMPT)])
    r = Runner(ours)
    first = r.step([("a", PROMPT[:7])])
    second = r.step([("a", PROMPT[7:])])
    torch.testing.assert_close(torch.cat([first, second]), one, atol=1e-5, rtol=1e-5)
    # a decode of "a" and a 2-chunk prefill of "b" share steps with it
    r.step([("b", PROMPT[:6])])
    mixed = r.step([("a", [MORE[0]]), ("b", PROMPT[6:])])
    alone = Runner(ours)
    alone.step([("a", PROMPT)])
    torch.testing.assert_close(mixed[0], alone.step([("a", [MORE[0]])])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1:], one[6:], atol=1e-5, rtol=1e-5)


def test_bare_checkpoint_names_and_tied_head():
    hf, ours = make_pair("Gemma3ForCausalLM", strip_prefix=True)  # Gemma 3 ties the head by default
    torch.testing.assert_close(Runner(ours).step([("a", PROMPT)]), hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_load_weights_errors():
    hf, ours = make_pair("LlamaForCausalLM")
    sd = dict(hf.state_dict())
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        ours.load_weights(list(sd.items()) + [("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])
    del sd["model.layers.1.mlp.up_proj.weight"], sd["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing.*lm_head.weight.*model.layers.1.mlp.gate_up_proj.weight"):
        ours.load_weights(sd.items())
    loaded = make_pair("Qwen3ForCausalLM")[1].load_weights(make_pair("Qwen3ForCausalLM")[0].state_dict().items())
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded and "lm_head.weight" not in loaded


def test_registry_and_spec():
    assert set(ARCHS) <= set(MODEL_REGISTRY)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(["NopeForCausalLM"])
    _, g = make_pair("Gemma3ForCausalLM")
    assert g.get_kv_cache_spec() == (3, 1, 32)
    assert [l.self_attn.attn.sliding_window for l in g.model.layers] == [4, None, 4]


def test_bf16_close_to_fp32():
    hf, _ = make_pair("Gemma3ForCausalLM")
    ours = get_model_class(["Gemma3ForCausalLM"])(hf.config, torch.bfloat16)
    ours.load_weights(hf.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    r = Runner(ours)
    r.caches = [c.bfloat16() for c in r.caches]
    logits = r.step([("a", PROMPT)])
    assert logits.dtype == torch.float32
    ref = hf_logits(hf, PROMPT)
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


def test_llama3_rope_scaling(monkeypatch):
    def config(arch, base=make_config):
        c = base(arch)
        c.rope_parameters = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        return c

    monkeypatch.setattr(sys.modules[__name__], "make_config", config)
    hf, ours = make_pair("LlamaForCausalLM")
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(Runner(ours).step([("a", PROMPT)]), hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)
