"""A tiny random Llama checkpoint (HF directory, word-level tokenizer) for engine-level
speculative decoding tests: random weights loop on short cycles, so n-gram/suffix drafts are
often accepted and often rejected."""
from __future__ import annotations

import os

import torch

TINY_VOCAB = 128


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY_VOCAB - 3)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def init_tiny_weights(model: torch.nn.Module) -> None:
    """Redraw ``model``'s matrices in place: embeddings N(0, 1), an untied ``lm_head`` N(0, 0.25),
    layer matrices N(0, 0.1); vectors (norms, biases) keep their init.

    Small layer weights make a random model fall into cycles and half-repeats, so drafts are
    often, but far from always, accepted; the continuations still vary.
    """
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 if "embed" in n else (0.25 if "lm_head" in n else 0.1))


def save_tiny(model: torch.nn.Module, d: str) -> str:
    """``init_tiny_weights(model)``, then save it with ``tiny_tokenizer()`` to ``d``; returns ``d``."""
    init_tiny_weights(model)
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def write_tiny_llama(d: str, seed: int = 0, layers: int = 2) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isdir(d):
        return d
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return save_tiny(LlamaForCausalLM(cfg).float().eval(), d)


def tiny_prompts(n: int = 8, seed: int = 0) -> list[dict]:
    """``n`` token-id prompts of 12-40 tokens, each with a repeated stretch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(6, 20, (1,), generator=g))
        base = torch.randint(3, TINY_VOCAB, (L,), generator=g).tolist()
        out.append({"prompt_token_ids": base + base[: L // 2] + base})
    return out


def write_tiny_gemma3(d: str, seed: int = 0) -> str:
    """A tiny random Gemma 3 text checkpoint with sliding and full layers (window 8, so the
    window matters for the tests' 30-90 token sequences), word-level tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if os.path.isdir(d):
        return d
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           sliding_window=8, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    # NOTE: an untied head (a tied random Gemma repeats one token forever).
    return save_tiny(Gemma3ForCausalLM(cfg).float().eval(), d)


def _save_head(d: str, W: dict, config: dict) -> str:
    import json

    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    save_file({k: v.contiguous() for k, v in W.items()}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


def mtp_head_config(target_cfg, layers=("sliding_attention", "full_attention"), hidden=32, inter=64,
                    centroids=None) -> dict:
    """A ``gemma4_assistant``-style config.json (dict) for a drafter of ``target_cfg``."""
    text = {"model_type": "gemma3_text", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": len(layers), "layer_types": list(layers),
            "num_attention_heads": target_cfg.num_attention_heads,
            "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
            "vocab_size": target_cfg.vocab_size, "rms_norm_eps": 1e-6,
            "sliding_window": getattr(target_cfg, "sliding_window", None),
            "query_pre_attn_scalar": target_cfg.head_dim,
            "rope_parameters": dict(target_cfg.rope_parameters), "hidden_activation": "gelu_pytorch_tanh"}
    cfg = {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"],
           "backbone_hidden_size": target_cfg.hidden_size, "text_config": text, "tie_word_embeddings": True,
           "use_ordered_embeddings": centroids is not None}
    if centroids is not None:
        cfg["num_centroids"], cfg["centroid_intermediate_top_k"] = centroids
    return cfg


def mtp_head_weights(cfg: dict, seed: int = 0, s: float = 0.1) -> dict:
    """Random tensors in the ``gemma4_assistant`` layout for ``cfg`` (``mtp_head_config``)."""
    t = cfg["text_config"]
    g = torch.Generator().manual_seed(seed)
    Hd, Hb, I, V = t["hidden_size"], cfg["backbone_hidden_size"], t["intermediate_size"], t["vocab_size"]
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]

    def r(*shape, scale=s):
        return torch.randn(*shape, generator=g) * scale
    W = {"model.embed_tokens.weight": r(V, Hd, scale=1.0), "model.norm.weight": r(Hd),
         "pre_projection.weight": r(Hd, 2 * Hb), "post_projection.weight": r(Hb, Hd)}
    for i in range(t["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            W[p + n + ".weight"] = r(Hd)
        W[p + "self_attn.q_proj.weight"] = r(nh * hd, Hd)
        W[p + "self_attn.q_norm.weight"] = r(hd)
        W[p + "self_attn.o_proj.weight"] = r(Hd, nh * hd)
        W[p + "mlp.gate_proj.weight"] = r(I, Hd)
        W[p + "mlp.up_proj.weight"] = r(I, Hd)
        W[p + "mlp.down_proj.weight"] = r(Hd, I)
    if cfg.get("use_ordered_embeddings"):
        C = cfg["num_centroids"]
        W["masked_embedding.centroids.weight"] = r(C, Hd, scale=1.0)
        W["masked_embedding.token_ordering"] = torch.randperm(V, generator=g)
    return W


def write_mtp_head(d: str, target_dir: str, seed: int = 0, **kw) -> str:
    """A random MTP drafter for the checkpoint at ``target_dir`` (``mtp_head_config`` kwargs)."""
    from transformers import AutoConfig

    cfg = mtp_head_config(AutoConfig.from_pretrained(target_dir), **kw)
    return _save_head(d, mtp_head_weights(cfg, seed), cfg)


def eagle3_head_config(target_cfg, aux=(0, 1, 1), draft_vocab=None) -> dict:
    H = target_cfg.hidden_size
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": 2 * H, "num_attention_heads": target_cfg.num_attention_heads,
            "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
            "num_hidden_layers": 1, "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab or
            target_cfg.vocab_size, "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 512,
            "target_hidden_size": H, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}


def eagle3_head_weights(cfg: dict, seed: int = 0, s: float = 0.1) -> dict:
    g = torch.Generator().manual_seed(seed)
    H, I, nh, nkv, hd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                         cfg["num_key_value_heads"], cfg["head_dim"])
    DV, V = cfg["draft_vocab_size"], cfg["vocab_size"]

    def r(*shape, scale=s):
        return torch.randn(*shape, generator=g) * scale
    W = {"fc.weight": r(H, 3 * H), "norm.weight": torch.ones(H), "lm_head.weight": r(DV, H, scale=0.3),
         "d2t": torch.sort(torch.randperm(V, generator=g)[:DV]).values - torch.arange(DV)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        W[f"midlayer.{n}.weight"] = torch.ones(H)
    for n, shape in (("q_proj", (nh * hd, 2 * H)), ("k_proj", (nkv * hd, 2 * H)), ("v_proj", (nkv * hd, 2 * H)),
                     ("o_proj", (H, nh * hd))):
        W[f"midlayer.self_attn.{n}.weight"] = r(*shape)
    for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        W[f"midlayer.mlp.{n}.weight"] = r(*shape)
    return W


def write_eagle3_head(d: str, target_dir: str, seed: int = 0, **kw) -> str:
    """A random EAGLE-3 head for the checkpoint at ``target_dir`` in the published layout."""
    from transformers import AutoConfig

    cfg = eagle3_head_config(AutoConfig.from_pretrained(target_dir), **kw)
    return _save_head(d, eagle3_head_weights(cfg, seed), cfg)


# ------------------------------------------------------------------ training a drafter in a test
def target_features(model, seqs: list[list[int]], block_size: int = 16):
    """Run the pagedllm ``model`` (a CausalLM) over each token sequence as one prefill with a
    paged cache; returns per sequence ``(hidden [N, H], K, V)`` with K/V per layer dense
    ``[N, Hkv, D]`` float32: exactly what the engine's cache holds and what the runner feeds the
    proposer."""
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata
    from pagedllm.spec_decode.mtp import gather_paged_kv

    layers, nkv, hd = model.get_kv_cache_spec()
    out = []
    for s in seqs:
        nb = -(-len(s) // block_size)
        caches = [torch.zeros(nb + 1, 2, block_size, nkv, hd) for _ in range(layers)]
        blocks = list(range(1, nb + 1))
        meta = build_metadata([(0, len(s), blocks)], block_size)
        with torch.inference_mode(), set_forward_context(ForwardContext(meta, caches, TorchPagedAttention())):
            h = model(torch.tensor(s), torch.arange(len(s)))
        bt = torch.tensor([blocks])
        kv = [gather_paged_kv(c, bt, len(s)) for c in caches]
        out.append((h.clone(), [k[0].clone() for k, _ in kv], [v[0].clone() for _, v in kv]))
    return out


def rope(x, pos, theta):
    """x [T, h, D] rotated HF-style (rotate_half) at positions pos [T] (rope_theta ``theta``)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _grms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def mtp_train_forward(W: dict, cfg: dict, kv_layers: list[int], emb_in, h, K, V, qpos):
    """Differentiable MTP step for ``M`` queries of one sequence (mirrors ``MTPHead``):
    ``emb_in [M, Hb]`` the target's scaled embedding of the input token, ``h [M, Hb]``,
    ``K/V`` per target layer ``[N, Hkv, D]``, ``qpos int64 [M]`` the query positions (keys
    ``< qpos``). Returns ``(logits [M, V], h_next [M, Hb])``."""
    t = cfg["text_config"]
    nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    rp = t["rope_parameters"]
    x = torch.cat([emb_in, h], -1) @ W["pre_projection.weight"].T
    M, N = x.shape[0], K[0].shape[0]
    keys = torch.arange(N)
    for i, (lt, kvl) in enumerate(zip(t["layer_types"], kv_layers)):
        p = f"model.layers.{i}."
        theta = (rp[lt] if lt in rp else rp)["rope_theta"]
        a = _grms(x, W[p + "input_layernorm.weight"])
        q = _grms((a @ W[p + "self_attn.q_proj.weight"].T).view(M, nh, hd), W[p + "self_attn.q_norm.weight"])
        q = rope(q, qpos, theta)
        k = K[kvl].repeat_interleave(nh // nkv, 1)
        v = V[kvl].repeat_interleave(nh // nkv, 1)
        s = torch.einsum("mhd,nhd->mhn", q, k) * t["query_pre_attn_scalar"] ** -0.5
        valid = keys[None] < qpos[:, None]
        if lt == "sliding_attention":
            valid &= keys[None] > (qpos - t["sliding_window"])[:, None]
        s = s.masked_fill(~valid[:, None], float("-inf"))
        o = torch.einsum("mhn,nhd->mhd", s.softmax(-1), v).reshape(M, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
        x = x + _grms(o, W[p + "post_attention_layernorm.weight"])
        m = _grms(x, W[p + "pre_feedforward_layernorm.weight"])
        m = (torch.nn.functional.gelu(m @ W[p + "mlp.gate_proj.weight"].T, approximate="tanh")
             * (m @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
        x = x + _grms(m, W[p + "post_feedforward_layernorm.weight"])
    normed = _grms(x, W["model.norm.weight"])
    return normed @ W["model.embed_tokens.weight"].T, normed @ W["post_projection.weight"].T


def train_mtp_head(d: str, target_dir: str, model, seqs: list[list[int]], prompt_lens: list[int],
                   steps: int = 300, k: int = 2, seed: int = 0, **cfg_kw) -> str:
    """Train a random MTP drafter for ``steps`` Adam steps on the target's own sequences (prompt +
    greedy continuation): draft ``j`` (teacher-forced input, fed-back hidden) at query position
    ``c`` learns token ``c + j``, for every ``c`` whose targets are generated tokens. Saves it in
    the checkpoint layout under ``d``."""
    from transformers import AutoConfig

    from pagedllm.spec_decode.mtp import default_mtp_kv_layers

    tcfg = AutoConfig.from_pretrained(target_dir)
    cfg = mtp_head_config(tcfg, **cfg_kw)
    t = cfg["text_config"]
    kv_layers = default_mtp_kv_layers(getattr(tcfg, "layer_types", None) or ["full_attention"] *
                                      tcfg.num_hidden_layers, t["layer_types"])
    torch.manual_seed(seed)
    W = {n: v.clone().float().requires_grad_(v.is_floating_point())
         for n, v in mtp_head_weights(cfg, seed).items()}
    feats = target_features(model, seqs)
    emb = model.model.embed_tokens.weight.detach().float()
    scale = float(getattr(model.model, "embed_scale", torch.tensor(1.0)))
    data = []
    for s, P, (h, K, V) in zip(seqs, prompt_lens, feats):
        ids = torch.tensor(s)
        c = torch.arange(max(1, P - 1), len(s) - k)  # query positions; token at c is the input
        data.append((ids, c, h.float(), K, V))
    opt = torch.optim.Adam([v for v in W.values() if v.requires_grad], lr=3e-3)
    with torch.enable_grad():
        for it in range(steps):
            ids, c, h, K, V = data[it % len(data)]
            hid, tok = h[c - 1], ids[c]
            loss = 0.0
            for j in range(1, k + 1):
                logits, hid = mtp_train_forward(W, cfg, kv_layers, emb[tok] * scale, hid, K, V, c)
                loss = loss + torch.nn.functional.cross_entropy(logits, ids[c + j])
                tok = ids[c + j]  # teacher forcing
            opt.zero_grad()
            loss.backward()
            opt.step()
    return _save_head(d, {n: v.detach() for n, v in W.items()}, cfg)


def tiny_gemma4_config(**over):
    """A scaled-down Gemma 4 text config with everything Gemma 3 lacks: sliding + full layers with
    different head shapes (full: ``global_head_dim`` 32, ``attention_k_eq_v`` with one KV head;
    sliding: head_dim 16, two KV heads), proportional rope on the full layers, the last two layers
    sharing earlier layers' KV (double-wide MLP there), per-layer embeddings, final soft-cap."""
    from transformers import Gemma4TextConfig

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
              use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB,
              sliding_window=8, max_position_embeddings=512, final_logit_softcapping=15.0,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"],
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    kw.update(over)
    return Gemma4TextConfig(**kw)


def write_tiny_gemma4(d: str, seed: int = 0, **over) -> str:
    """A tiny random ``Gemma4ForCausalLM`` checkpoint (``tiny_gemma4_config``) saved with
    ``save_pretrained``, word-level tokenizer."""
    from transformers import Gemma4ForCausalLM

    if os.path.isdir(d):
        return d
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(tiny_gemma4_config(**over)).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 if "embed" in n else (0.25 if "lm_head" in n else 0.1))
            elif "norm" in n:
                p.normal_(1.0, 0.2)  # NOTE: Gemma 4 norms multiply by w (not 1 + w)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.9)
    model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d
