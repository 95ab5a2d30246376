"""EAGLE, EAGLE-3 and Gemma-4-style MTP draft heads on tiny random weights, loaded from
checkpoints in the published layouts, against straightforward dense reference implementations
(plain tensors: causal attention over unpaged K/V)."""
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3TextConfig, LlamaConfig

from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata
from pagedllm.spec_decode.eagle import Eagle3Head, EagleHead, eagle3_aux_layer_ids
from pagedllm.spec_decode.mtp import MTPHead, default_mtp_kv_layers
from spec_helpers import rope

torch.set_num_threads(1)
H, NH, NKV, D, I, V = 32, 4, 2, 8, 48, 40
BS = 4


def rand(*shape, s=0.3):
    return torch.randn(*shape) * s


def rms(x, w, eps=1e-5, gemma=False):
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return n * (1 + w) if gemma else n * w


def ref_attn(x_q, x_kv, W, p, pos, theta):
    """Causal GQA attention; q from x_q, k/v from x_kv (same length), Llama weights W[p+...]."""
    T = x_q.shape[0]
    q = (x_q @ W[p + "q_proj.weight"].T).view(T, NH, D)
    k = (x_kv @ W[p + "k_proj.weight"].T).view(T, NKV, D)
    v = (x_kv @ W[p + "v_proj.weight"].T).view(T, NKV, D)
    q, k = rope(q, pos, theta), rope(k, pos, theta)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, NH * D)
    return o @ W[p + "o_proj.weight"].T


def ref_mlp(x, W, p, act=F.silu):
    return (act(x @ W[p + "gate_proj.weight"].T) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def llama_cfg(**kw):
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                       num_attention_heads=NH, num_key_value_heads=NKV, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)


def run_paged(head, fn, T):
    """Run ``fn(ids, pos)`` as a prefill of T-1 tokens then a one-token decode, with the head's
    own paged cache (blocks handed out in reverse); returns the concatenated outputs."""
    cache = torch.zeros(8, 2, BS, NKV, D)
    blocks = [7, 5, 6, 2]
    outs = []
    for start, n in ((0, T - 1), (T - 1, 1)):
        meta = build_metadata([(start, n, blocks)], BS)
        with torch.no_grad(), set_forward_context(ForwardContext(meta, [cache], TorchPagedAttention())):
            outs.append(fn(slice(start, start + n), torch.arange(start, start + n)))
    return outs


def test_eagle_head_matches_reference():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H)
    W = {"fc.weight": rand(H, 2 * H)}
    for n, shape in (("q_proj", (NH * D, H)), ("k_proj", (NKV * D, H)), ("v_proj", (NKV * D, H)),
                     ("o_proj", (H, NH * D))):
        W[f"layers.0.self_attn.{n}.weight"] = rand(*shape)
    for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        W[f"layers.0.mlp.{n}.weight"] = rand(*shape)
    W["layers.0.post_attention_layernorm.weight"] = 1 + rand(H, s=0.1)
    W["embed_tokens.weight"] = emb.weight.detach()  # published checkpoints may carry it: skipped
    head = EagleHead(llama_cfg(), emb)
    head.load_weights(W.items())
    T = 11
    ids = torch.randint(0, V, (T,))
    hid = rand(T, H, s=1.0)
    # Reference: fc -> layer without input norm -> h + residual.
    x = torch.cat([emb(ids), hid], -1) @ W["fc.weight"].T
    pos = torch.arange(T)
    h = x + ref_attn(x, x, W, "layers.0.self_attn.", pos, 10000.0)
    ref = h + ref_mlp(rms(h, W["layers.0.post_attention_layernorm.weight"]), W, "layers.0.mlp.")
    outs = run_paged(head, lambda s, p: head(ids[s], p, hid[s]), T)
    torch.testing.assert_close(torch.cat(outs), ref.detach(), atol=1e-4, rtol=1e-4)


def test_eagle3_head_matches_reference_and_maps_the_draft_vocab():
    torch.manual_seed(1)
    emb = torch.nn.Embedding(V, H)
    DV = 24
    W = {"fc.weight": rand(H, 3 * H), "norm.weight": 1 + rand(H, s=0.1), "lm_head.weight": rand(DV, H),
         "d2t": torch.sort(torch.randperm(V)[:DV]).values - torch.arange(DV),
         "t2d": torch.zeros(V, dtype=torch.bool)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        W[f"midlayer.{n}.weight"] = 1 + rand(H, s=0.1)
    for n, shape in (("q_proj", (NH * D, 2 * H)), ("k_proj", (NKV * D, 2 * H)), ("v_proj", (NKV * D, 2 * H)),
                     ("o_proj", (H, NH * D))):
        W[f"midlayer.self_attn.{n}.weight"] = rand(*shape)
    for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        W[f"midlayer.mlp.{n}.weight"] = rand(*shape)
    head = Eagle3Head(llama_cfg(draft_vocab_size=DV), emb)
    head.load_weights(W.items())
    T = 9
    ids = torch.randint(0, V, (T,))
    aux = rand(T, 3 * H, s=1.0)
    hid = aux @ W["fc.weight"].T
    e = rms(emb(ids), W["midlayer.input_layernorm.weight"])
    a_in = torch.cat([e, rms(hid, W["midlayer.hidden_norm.weight"])], -1)
    h = hid + ref_attn(a_in, a_in, W, "midlayer.self_attn.", torch.arange(T), 10000.0)
    pre = h + ref_mlp(rms(h, W["midlayer.post_attention_layernorm.weight"]), W, "midlayer.mlp.")
    normed = rms(pre, W["norm.weight"])
    outs = run_paged(head, lambda s, p: head(ids[s], p, aux[s]), T)
    got_normed = torch.cat([o[0] for o in outs])
    got_pre = torch.cat([o[1] for o in outs])
    torch.testing.assert_close(got_normed, normed.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_pre, pre.detach(), atol=1e-4, rtol=1e-4)
    logits = head.compute_logits(got_normed)
    dl = normed @ W["lm_head.weight"].T
    tgt = torch.arange(DV) + W["d2t"]
    torch.testing.assert_close(logits[:, tgt], dl.detach(), atol=1e-4, rtol=1e-4)
    others = torch.ones(V, dtype=torch.bool)
    others[tgt] = False
    assert torch.isinf(logits[:, others]).all()
    # A later step feeds back the H-wide pre-norm output (no fc).
    with torch.no_grad(), set_forward_context(ForwardContext(build_metadata([(0, 1, [1])], BS),
                                                             [torch.zeros(2, 2, BS, NKV, D)], TorchPagedAttention())):
        n2, p2 = head(ids[:1], torch.zeros(1, dtype=torch.long), got_pre[:1])
    assert n2.shape == (1, H) and torch.isfinite(p2).all()
    assert eagle3_aux_layer_ids(30) == (2, 15, 27)


def test_eagle_loader_names_unexpected_and_missing():
    emb = torch.nn.Embedding(V, H)
    head = EagleHead(llama_cfg(), emb)
    with pytest.raises(ValueError, match="unexpected"):
        head.load_weights([("layers.0.self_attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing"):
        head.load_weights([("fc.weight", torch.zeros(H, 2 * H))])


# ------------------------------------------------------------------ MTP (Gemma 4 style)
HB, HD, MV = 24, 16, 40  # backbone hidden, drafter hidden, vocab


def mtp_cfg():
    cfg = Gemma3TextConfig(vocab_size=MV, hidden_size=HD, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=NH, num_key_value_heads=NKV, head_dim=D, rms_norm_eps=1e-6,
                           sliding_window=5, query_pre_attn_scalar=D,
                           layer_types=["sliding_attention", "full_attention"],
                           hidden_activation="gelu_pytorch_tanh")
    cfg.backbone_hidden_size = HB
    return cfg


def mtp_weights():
    W = {"model.embed_tokens.weight": rand(MV, HD, s=1.0), "model.norm.weight": rand(HD, s=0.1),
         "pre_projection.weight": rand(HD, 2 * HB), "post_projection.weight": rand(HB, HD)}
    for i in range(2):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            W[p + n + ".weight"] = rand(HD, s=0.1)
        W[p + "self_attn.q_proj.weight"] = rand(NH * D, HD)
        W[p + "self_attn.q_norm.weight"] = rand(D, s=0.1)
        W[p + "self_attn.o_proj.weight"] = rand(HD, NH * D)
        W[p + "mlp.gate_proj.weight"] = rand(32, HD)
        W[p + "mlp.up_proj.weight"] = rand(32, HD)
        W[p + "mlp.down_proj.weight"] = rand(HD, 32)
    return W


def ref_mtp_step(W, tok_emb, h, K, Vv, ctx_len, kv_layers, windows, thetas=(10000.0, 1e6)):
    """One drafter step for one request; K/Vv: per target layer dense [L, Hkv, D]."""
    x = torch.cat([tok_emb, h]) @ W["pre_projection.weight"].T
    pos = torch.tensor([ctx_len])
    for i, (kv, win) in enumerate(zip(kv_layers, windows)):
        p = f"model.layers.{i}."
        a = rms(x, W[p + "input_layernorm.weight"], 1e-6, gemma=True)
        q = (a @ W[p + "self_attn.q_proj.weight"].T).view(1, NH, D)
        # Each layer uses the rope of its type (Gemma 3 defaults: sliding 1e4, full 1e6).
        q = rope(rms(q, W[p + "self_attn.q_norm.weight"], 1e-6, gemma=True), pos, thetas[i])[0]
        keys = range(max(0, ctx_len - win + 1) if win else 0, ctx_len)
        k = K[kv][list(keys)].repeat_interleave(NH // NKV, 1)
        v = Vv[kv][list(keys)].repeat_interleave(NH // NKV, 1)
        s = torch.einsum("hd,lhd->hl", q, k) / math.sqrt(D)
        o = torch.einsum("hl,lhd->hd", s.softmax(-1), v).reshape(NH * D) @ W[p + "self_attn.o_proj.weight"].T
        x = x + rms(o, W[p + "post_attention_layernorm.weight"], 1e-6, gemma=True)
        m = rms(x, W[p + "pre_feedforward_layernorm.weight"], 1e-6, gemma=True)
        m = ref_mlp(m, W, p + "mlp.", act=lambda t: F.gelu(t, approximate="tanh"))
        x = x + rms(m, W[p + "post_feedforward_layernorm.weight"], 1e-6, gemma=True)
    normed = rms(x, W["model.norm.weight"], 1e-6, gemma=True)
    return normed, normed @ W["post_projection.weight"].T


def test_mtp_head_reads_the_target_cache_like_the_reference():
    torch.manual_seed(2)
    cfg = mtp_cfg()
    target_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    kv_layers = default_mtp_kv_layers(target_types, cfg.layer_types)
    assert kv_layers == [2, 3]
    tgt_emb = torch.nn.Embedding(MV, HB)
    W = mtp_weights()
    head = MTPHead(cfg, kv_layers, lambda t: tgt_emb(t) * HB ** 0.5)
    head.load_weights(W.items())
    # A target cache with two requests of different lengths, blocks scattered.
    lens = [9, 14]
    tables = [[3, 9, 1], [8, 2, 6, 4]]
    caches = [torch.zeros(10, 2, BS, NKV, D) for _ in range(4)]
    K = [[None] * 2 for _ in range(4)]
    Vv = [[None] * 2 for _ in range(4)]
    for layer in range(4):
        for r, (L, tab) in enumerate(zip(lens, tables)):
            k, v = rand(L, NKV, D, s=1.0), rand(L, NKV, D, s=1.0)
            K[layer][r], Vv[layer][r] = k, v
            for pos in range(L):
                caches[layer][tab[pos // BS], 0, pos % BS] = k[pos]
                caches[layer][tab[pos // BS], 1, pos % BS] = v[pos]
    bt = torch.zeros(2, 4, dtype=torch.long)
    for r, tab in enumerate(tables):
        bt[r, :len(tab)] = torch.tensor(tab)
    ctx = torch.tensor(lens)
    toks = torch.tensor([5, 17])
    h = rand(2, HB, s=1.0)
    # Two draft steps from the same position: the second feeds back h_next and its own draft.
    with torch.no_grad():
        for step in range(2):
            normed, h_next = head(toks, h, caches, bt, ctx)
            for r in range(2):
                rn, rh = ref_mtp_step(W, tgt_emb(toks[r]) * HB ** 0.5, h[r], [K[i][r] for i in range(4)],
                                      [Vv[i][r] for i in range(4)], lens[r], kv_layers, [5, None])
                torch.testing.assert_close(normed[r], rn, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(h_next[r], rh, atol=1e-4, rtol=1e-4)
            logits = head.compute_logits(normed)
            torch.testing.assert_close(logits, normed @ W["model.embed_tokens.weight"].T, atol=1e-4, rtol=1e-4)
            toks, h = logits.argmax(-1), h_next


def test_mtp_loader_rejects_centroids_and_checks_layers():
    cfg = mtp_cfg()
    head = MTPHead(cfg, [0, 1], lambda t: torch.zeros(t.shape[0], HB))
    W = mtp_weights()
    W["masked_embedding.centroids.weight"] = torch.zeros(4, HD)
    with pytest.raises(ValueError, match="masked_embedding"):
        head.load_weights(W.items())
    with pytest.raises(ValueError, match="kv_layers"):
        MTPHead(cfg, [0], lambda t: t)
    with pytest.raises(ValueError, match="no 'full_attention'"):
        default_mtp_kv_layers(["sliding_attention"], ["full_attention"])
