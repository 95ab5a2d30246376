"""Trained model drafters, single stream: tok/s with and without drafting and the mean acceptance
length (issue 38's benchmark).

1. **SmolLM2-135M-Instruct + an EAGLE-3 head trained here** (default GGUF weights, Q4_1 blocks
   kept quantized). The head is trained the way ``tests/spec_decode/test_mtp_trained.py`` trains
   its MTP drafter: on the target's own greedy continuations (chat prompts that are not the
   benchmark's), with the target's features computed by pagedllm itself (a paged prefill with
   ``AuxHiddenCapture``, i.e. exactly what the engine feeds the head: the residual streams entering
   layers 2, 15 and 27). Training mirrors ``Eagle3Head`` and the proposer's indexing (head
   position ``p``: the token at ``p + 1`` and the target's features at ``p``) for two draft steps,
   the second with the fed-back pre-norm output at ``p + 1`` attending the step-1 keys at
   ``0..p`` plus its own (EAGLE-3's training-time test); Adam, a wall-clock budget
   (``--train-seconds``). Draft vocabulary: the ``--draft-vocab`` most frequent tokens of the
   training sequences (``d2t``); its LM head starts from the target's (tied) embedding rows, ``fc``
   from "pass the high feature through". Saved in the published EAGLE-3 layout (``midlayer.*``,
   ``fc``, ``norm``, ``lm_head``, ``d2t``, ``config.json`` with ``eagle_aux_hidden_state_layer_ids``).
2. **The tiny pair**: the tiny Gemma 3 test target with the MTP drafter trained exactly as in
   ``test_mtp_trained.py`` (``tests/spec_decode/spec_helpers.py``).

Each configuration is loaded once; passes alternate between them (one warm-up, then
``--repeats``); medians. Greedy, so every configuration emits the same tokens (checked).

    env PYTHONPATH=. python benchmarks/spec_decode_trained.py \\
        --json-output benchmarks/results/spec-decode-trained-DATE.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

TRAIN_TOPICS = ["the moon", "volcanoes", "a lighthouse keeper", "bread baking", "the French revolution",
                "photosynthesis", "a lost cat", "chess openings", "rainforests", "the stock market",
                "learning to swim", "electric cars", "honey bees", "a rainy day in London", "the piano",
                "black holes", "gardening in spring", "the Roman empire", "coffee", "a mountain village"]
TRAIN_TEMPLATES = ["Write a short paragraph about {}.", "Explain {} to a ten-year-old.",
                   "Give me three facts about {}."]


def cpu_info() -> dict:
    flags, model = set(), platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16"]
    return {"model": model, "flags": [f for f in keep if f in flags], "cores": os.cpu_count()}


# ------------------------------------------------------------------ EAGLE-3 training
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, inv_freq):
    f = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def eagle3_train_step(W, c, emb_in, hidden, pos, inv_freq, keys=None):
    """Differentiable ``Eagle3Head`` step for ``M`` query rows of one sequence.

    Args:
        W: the head's tensors (checkpoint names); c: the config dict.
        emb_in: ``[M, H]`` the target's embedding of each row's input token.
        hidden: ``[M, 3H]`` target features (step 1) or ``[M, H]`` fed-back pre-norm (step 2).
        pos: int64 ``[M]`` the rows' head positions.
        keys: None (step 1: causal over these rows) or the step-1 ``(K, V)`` ``[M, Hkv, D]``: row
            ``i`` (at position ``pos0[i] + 1``) attends step-1 rows ``0..i`` plus its own key.

    Returns:
        ``(logits [M, draft vocab], prenorm [M, H], (K, V))``.
    """
    H, nh, nkv, eps = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    hd = c["head_dim"]
    if hidden.shape[-1] != H:
        hidden = hidden @ W["fc.weight"].T
    M = hidden.shape[0]
    a = torch.cat([_rms(emb_in, W["midlayer.input_layernorm.weight"], eps),
                   _rms(hidden, W["midlayer.hidden_norm.weight"], eps)], -1)
    q = (a @ W["midlayer.self_attn.q_proj.weight"].T).view(M, nh, hd)
    k = (a @ W["midlayer.self_attn.k_proj.weight"].T).view(M, nkv, hd)
    v = (a @ W["midlayer.self_attn.v_proj.weight"].T).view(M, nkv, hd)
    q, k = _rope(q, pos, inv_freq), _rope(k, pos, inv_freq)
    rep = nh // nkv
    scale = hd ** -0.5
    if keys is None:
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("mhd,nhd->hmn", q, kk) * scale
        mask = torch.ones(M, M, dtype=torch.bool).tril()
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        o = torch.einsum("hmn,nhd->mhd", p, vv)
    else:
        K1, V1 = (t.repeat_interleave(rep, 1) for t in keys)
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s1 = torch.einsum("mhd,nhd->hmn", q, K1) * scale
        s1 = s1.masked_fill(~torch.ones(M, M, dtype=torch.bool).tril(), float("-inf"))
        s2 = (q * kk).sum(-1).T[:, :, None] * scale  # [h, M, 1] the row's own key
        p = torch.cat([s1, s2], -1).softmax(-1)
        o = torch.einsum("hmn,nhd->mhd", p[..., :M], V1) + p[..., M:].permute(1, 0, 2) * vv
    o = o.reshape(M, nh * hd) @ W["midlayer.self_attn.o_proj.weight"].T
    x = o + hidden
    h = _rms(x, W["midlayer.post_attention_layernorm.weight"], eps)
    h = (torch.nn.functional.silu(h @ W["midlayer.mlp.gate_proj.weight"].T) * (h @ W["midlayer.mlp.up_proj.weight"].T)
         ) @ W["midlayer.mlp.down_proj.weight"].T
    pre = h + x
    logits = _rms(pre, W["norm.weight"], eps) @ W["lm_head.weight"].T
    return logits, pre, (k, v)


def smollm2_features(llm, seqs, layer_ids, block_size=16):
    """Per sequence the target's aux features ``[N, 3H]`` from a paged prefill of pagedllm's model."""
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata
    from pagedllm.spec_decode.eagle_proposer import AuxHiddenCapture

    model = llm.llm_engine.core.runner.model
    layers, nkv, hd = model.get_kv_cache_spec()
    cap = AuxHiddenCapture(model, layer_ids)
    out = []
    try:
        for s in seqs:
            nb = -(-len(s) // block_size)
            caches = [torch.zeros(nb + 1, 2, block_size, nkv, hd) for _ in range(layers)]
            meta = build_metadata([(0, len(s), list(range(1, nb + 1)))], block_size)
            with torch.inference_mode(), set_forward_context(ForwardContext(meta, caches, TorchPagedAttention())):
                model(torch.tensor(s), torch.arange(len(s)))
            out.append(cap.take().float().clone())
    finally:
        for h in cap.handles:
            h.remove()
    return out


def train_eagle3(llm, out_dir: str, seqs, prompt_lens, seconds: float, draft_vocab: int, inter: int,
                 lr: float, seed: int = 0) -> dict:
    """Train and save an EAGLE-3 head for ``llm``'s target (see the module docstring); returns stats."""
    from pagedllm.spec_decode.eagle import eagle3_aux_layer_ids
    from safetensors.torch import save_file

    model = llm.llm_engine.core.runner.model
    tc = model.config
    H, n, V = int(tc.hidden_size), int(tc.num_hidden_layers), int(tc.vocab_size)
    nh, nkv = int(tc.num_attention_heads), int(tc.num_key_value_heads)
    hd = getattr(tc, "head_dim", None) or H // nh
    theta = float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", getattr(tc, "rope_theta", 10000.0)))
    aux = eagle3_aux_layer_ids(n)
    t0 = time.perf_counter()
    feats = smollm2_features(llm, seqs, aux)
    t_feat = time.perf_counter() - t0
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=V)
    DV = min(draft_vocab, int((counts > 0).sum()))
    sel = torch.sort(torch.topk(counts, DV).indices).values
    t2d = torch.full((V,), -100, dtype=torch.int64)
    t2d[sel] = torch.arange(DV)
    with torch.inference_mode():  # NOTE: through the lookup: a GGUF table may stay quantized
        emb = model.model.embed_tokens(torch.arange(V)).float().clone()
    fnorm = model.model.norm.weight.detach().float().clone()
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": DV, "rms_norm_eps": float(tc.rms_norm_eps),
           "hidden_act": "silu", "max_position_embeddings": int(tc.max_position_embeddings), "rope_theta": theta,
           "target_hidden_size": H, "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.02):
        return torch.randn(*shape, generator=g) * s
    fc = torch.zeros(H, 3 * H)
    fc[:, 2 * H:] = torch.eye(H)  # start by passing the high feature through
    W = {"fc.weight": fc + r(H, 3 * H, s=0.005), "norm.weight": fnorm, "lm_head.weight": emb[sel].clone(),
         "midlayer.input_layernorm.weight": torch.ones(H), "midlayer.hidden_norm.weight": torch.ones(H),
         "midlayer.post_attention_layernorm.weight": torch.ones(H),
         "midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * H), "midlayer.self_attn.k_proj.weight": r(nkv * hd, 2 * H),
         "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, nh * hd),
         "midlayer.mlp.gate_proj.weight": r(inter, H), "midlayer.mlp.up_proj.weight": r(inter, H),
         "midlayer.mlp.down_proj.weight": r(H, inter)}
    W = {k: v.float().requires_grad_(True) for k, v in W.items()}
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    data = []
    for s, P, F in zip(seqs, prompt_lens, feats):
        ids = torch.tensor(s)
        N = len(s)
        data.append((ids, F[: N - 1], P, N))
    opt = torch.optim.Adam(list(W.values()), lr=lr)
    steps, losses, t1 = 0, [], time.perf_counter()
    with torch.enable_grad():
        while time.perf_counter() - t1 < seconds:
            ids, F, P, N = data[steps % len(data)]
            pos = torch.arange(N - 1)
            l1, pre, kv = eagle3_train_step(W, cfg, emb[ids[1:N]], F, pos, inv_freq)
            # step 1 at p predicts t[p + 2]; step 2 (input t[p + 2] at p + 1) predicts t[p + 3]
            y1 = t2d[ids[2:N]]
            l2, _, _ = eagle3_train_step(W, cfg, emb[ids[2:N]], pre[: N - 2], pos[: N - 2] + 1, inv_freq,
                                         keys=(kv[0][: N - 2], kv[1][: N - 2]))
            y2 = t2d[ids[3:N]]
            # only positions whose targets are generated tokens (the serving case)
            m1 = torch.arange(N - 2) + 2 >= P
            m2 = torch.arange(N - 3) + 3 >= P
            y1 = torch.where(m1, y1, torch.full_like(y1, -100))
            y2 = torch.where(m2, y2, torch.full_like(y2, -100))
            loss = (torch.nn.functional.cross_entropy(l1[: N - 2], y1, ignore_index=-100)
                    + torch.nn.functional.cross_entropy(l2[: N - 3], y2, ignore_index=-100))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
            steps += 1
    t_train = time.perf_counter() - t1
    os.makedirs(out_dir, exist_ok=True)
    T = {k: v.detach().contiguous() for k, v in W.items()}
    T["d2t"] = sel - torch.arange(DV)
    save_file(T, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    k = max(1, len(losses) // 10)
    return {"steps": steps, "train_seconds": t_train, "feature_seconds": t_feat, "draft_vocab_size": DV,
            "intermediate_size": inter, "aux_layer_ids": list(aux), "loss_first": statistics.mean(losses[:k]),
            "loss_last": statistics.mean(losses[-k:]), "train_sequences": len(seqs),
            "train_tokens": sum(len(s) for s in seqs)}


# ------------------------------------------------------------------ single-stream timing
def spec_counts(llm):
    st = llm.llm_engine.core.scheduler.spec_stats
    return (st.num_drafts, st.num_accepted_tokens) if st is not None else (0, 0)


def single_stream(llms: dict, run, repeats: int) -> dict:
    """Alternate ``run(llm) -> (tokens, outputs)`` over the configurations; medians of tok/s."""
    tps = {n: [] for n in llms}
    acc = {n: [0, 0] for n in llms}
    outs: dict = {}
    for rep in range(repeats + 1):
        for n, llm in llms.items():
            d0, a0 = spec_counts(llm)
            t0 = time.perf_counter()
            toks, o = run(llm)
            el = time.perf_counter() - t0
            d1, a1 = spec_counts(llm)
            outs.setdefault(n, o)
            if rep == 0:
                continue
            tps[n].append(toks / el)
            acc[n][0] += d1 - d0
            acc[n][1] += a1 - a0
    base = statistics.median(tps["none"])
    ref = outs["none"]
    return {n: {"output_tokens_per_s": statistics.median(tps[n]), "runs": tps[n],
                "ratio_vs_none": statistics.median(tps[n]) / base,
                "mean_acceptance_length": (1 + acc[n][1] / acc[n][0]) if acc[n][0] else None,
                "num_drafts": acc[n][0], "outputs_equal_none": outs[n] == ref} for n in llms}


def main() -> None:
    from pagedllm import LLM, SamplingParams

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "spec_decode"))
    from spec_decode import CHAT  # noqa: E402  (benchmarks/spec_decode.py: the held-out chat prompts)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--quantization", default=None, help="None: the GGUF's blocks kept quantized")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--train-seconds", type=float, default=150.0)
    ap.add_argument("--train-max-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--intermediate-size", type=int, default=1536)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--num-chat", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list: smollm2, tiny")
    ap.add_argument("--head-dir", default=None, help="where to save the trained EAGLE-3 head (default: a temp dir)")
    ap.add_argument("--json-output", default=None)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    res: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu_info(),
                 "threads": args.num_threads, "train_threads": args.train_threads, "torch": torch.__version__,
                 "loadavg_start": os.getloadavg(), "args": vars(args)}
    tmp = tempfile.mkdtemp(prefix="spec_trained_")
    kw = dict(num_threads=args.num_threads, seed=0, kv_cache_memory=256 * 1024**2)

    if "smollm2" not in args.skip:
        torch.set_num_threads(args.train_threads)
        base = LLM(args.model, quantization=args.quantization, **kw)
        convs = [[{"role": "user", "content": t.format(x)}] for x in TRAIN_TOPICS for t in TRAIN_TEMPLATES]
        t0 = time.perf_counter()
        gen = base.chat(convs, SamplingParams(temperature=0.0, max_tokens=args.train_max_tokens), use_tqdm=False)
        t_gen = time.perf_counter() - t0
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in gen]
        plens = [len(o.prompt_token_ids) for o in gen]
        head = args.head_dir or os.path.join(tmp, "smollm2_eagle3")
        stats = train_eagle3(base, head, seqs, plens, args.train_seconds, args.draft_vocab, args.intermediate_size,
                             args.lr)
        stats["generate_seconds"] = t_gen
        print("trained", json.dumps(stats), flush=True)
        del base
        torch.set_num_threads(args.num_threads)
        llms = {"none": LLM(args.model, quantization=args.quantization, **kw)}
        for k in ks:
            llms[f"eagle3-k{k}"] = LLM(args.model, quantization=args.quantization, speculative_config={
                "method": "eagle3", "model": head, "num_speculative_tokens": k, "disable_by_batch_size": 0}, **kw)
        held = [[{"role": "user", "content": c}] for c in CHAT[: args.num_chat]]
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

        def run(llm):
            o = [tuple(llm.chat(c, sp, use_tqdm=False)[0].outputs[0].token_ids) for c in held]
            return sum(len(x) for x in o), o
        res["smollm2"] = {"model": args.model, "quantization": args.quantization, "head": head, "training": stats,
                          "workload": f"{len(held)} held-out chat prompts x <= {args.max_tokens} tokens, one at a time",
                          "configs": single_stream(llms, run, args.repeats)}
        print("smollm2", json.dumps({n: (round(r["output_tokens_per_s"], 2), round(r["ratio_vs_none"], 3),
                                         r["mean_acceptance_length"] and round(r["mean_acceptance_length"], 2))
                                     for n, r in res["smollm2"]["configs"].items()}), flush=True)
        del llms

    if "tiny" not in args.skip:
        from spec_helpers import tiny_prompts, train_mtp_head, write_tiny_gemma3

        tkw = dict(dtype="float32", seed=0, max_model_len=256, num_threads=args.num_threads)
        tdir = write_tiny_gemma3(os.path.join(tmp, "tiny_gemma3"))
        base = LLM(tdir, **tkw)
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        train = tiny_prompts(12, seed=21)
        outs = [o.outputs[0].token_ids for o in base.generate(train, sp, use_tqdm=False)]
        seqs = [p["prompt_token_ids"] + list(r) for p, r in zip(train, outs)]
        t0 = time.perf_counter()
        torch.set_num_threads(args.train_threads)
        head = train_mtp_head(os.path.join(tmp, "tiny_mtp"), tdir, base.llm_engine.core.runner.model, seqs,
                              [len(p["prompt_token_ids"]) for p in train], steps=240)
        torch.set_num_threads(args.num_threads)
        t_train = time.perf_counter() - t0
        llms = {"none": base}
        for k in ks:
            llms[f"mtp-k{k}"] = LLM(tdir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": k,
                                                              "disable_by_batch_size": 0}, **tkw)
        held = tiny_prompts(8, seed=99)
        sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)

        def run_tiny(llm):
            o = [tuple(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in held]
            return sum(len(x) for x in o), o
        res["tiny"] = {"target": "tiny Gemma 3 test target (64 wide, 4 layers, sliding + full)",
                       "drafter": "MTP trained as in tests/spec_decode/test_mtp_trained.py (240 Adam steps)",
                       "train_seconds": t_train, "workload": "8 held-out prompts x 128 tokens, one at a time",
                       "configs": single_stream(llms, run_tiny, args.repeats)}
        print("tiny", json.dumps({n: (round(r["output_tokens_per_s"], 1), round(r["ratio_vs_none"], 3),
                                      r["mean_acceptance_length"] and round(r["mean_acceptance_length"], 2))
                                  for n, r in res["tiny"]["configs"].items()}), flush=True)
    res["loadavg_end"] = os.getloadavg()
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
