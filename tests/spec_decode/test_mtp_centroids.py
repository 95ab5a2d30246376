"""The MTP drafter's centroid-masked sparse logits (Gemma 4 assistants' ordered embeddings):
one selection routine, whose sparse argmax equals the dense argmax restricted to the selected
candidates and whose full-vocabulary scatter equals the dense logits there and -inf elsewhere;
the same candidates and logits as transformers' ``Gemma4AssistantMaskedEmbedder``; a drafter
with centroids served lossless through the engine, loaded from ``masked_embedding.*``."""
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.mtp import centroid_candidates, scatter_candidates, sparse_argmax

from spec_helpers import tiny_prompts, write_mtp_head

V, HD, C, TOPK = 96, 16, 12, 3


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    normed = torch.randn(7, HD, generator=g)
    cent = torch.randn(C, HD, generator=g)
    order = torch.randperm(V, generator=g)
    emb = torch.randn(V, HD, generator=g)
    return normed, cent, order, emb


def test_sparse_argmax_and_scatter_match_the_dense_logits_on_the_candidates():
    normed, cent, order, emb = _setup()
    cand, logits = centroid_candidates(normed, cent, order.view(C, -1), emb, TOPK)
    assert cand.shape == logits.shape == (7, TOPK * V // C)
    dense = normed @ emb.T
    # The candidates are exactly the tokens of each row's top-K centroids.
    top = (normed @ cent.T).topk(TOPK, -1).indices
    for r in range(7):
        want = torch.cat([order.view(C, -1)[c] for c in top[r]])
        assert torch.equal(torch.sort(cand[r]).values, torch.sort(want).values)
    torch.testing.assert_close(logits, dense.gather(1, cand), atol=1e-5, rtol=1e-5)
    full = scatter_candidates(cand, logits, V)
    mask = torch.zeros(7, V, dtype=torch.bool)
    mask.scatter_(1, cand, True)
    torch.testing.assert_close(full[mask], dense[mask], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(full[~mask]).all()
    restricted = dense.masked_fill(~mask, float("-inf"))
    assert torch.equal(sparse_argmax(cand, logits), restricted.argmax(-1))
    assert torch.equal(full.argmax(-1), restricted.argmax(-1))


def test_same_as_transformers_masked_embedder():
    pytest.importorskip("transformers.models.gemma4_assistant")
    from transformers import Gemma4AssistantConfig
    from transformers.models.gemma4 import Gemma4TextConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

    normed, cent, order, emb = _setup(1)
    tc = Gemma4TextConfig(vocab_size=V, hidden_size=HD, num_hidden_layers=1, hidden_size_per_layer_input=0,
                          vocab_size_per_layer_input=0)
    m = Gemma4AssistantMaskedEmbedder(Gemma4AssistantConfig(text_config=tc, use_ordered_embeddings=True,
                                                            num_centroids=C, centroid_intermediate_top_k=TOPK))
    with torch.no_grad():
        m.centroids.weight.copy_(cent)
        m.token_ordering.copy_(order)
        hf = m(normed[None], emb)[0]
    cand, logits = centroid_candidates(normed, cent, order.view(C, -1), emb, TOPK)
    ours = scatter_candidates(cand, logits, V)
    sel = torch.isfinite(ours)
    torch.testing.assert_close(ours[sel], hf[sel], atol=1e-5, rtol=1e-5)
    assert (hf[~sel] < hf[sel].min()).all()  # HF fills the rest with min - 1; we use -inf
    assert torch.equal(ours.argmax(-1), hf.argmax(-1))


def test_centroid_drafter_served_lossless(tiny_gemma3_dir, tmp_path):
    head = write_mtp_head(str(tmp_path / "mtp_c"), tiny_gemma3_dir, seed=5, centroids=(16, 4))
    prompts = tiny_prompts(6, seed=31)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_gemma3_dir, **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(tiny_gemma3_dir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": 3,
                                                   "disable_by_batch_size": 0}, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == ref
    proposer = llm.llm_engine.core.runner.spec_decoder.proposer
    assert proposer.head.use_ordered_embeddings and proposer.head.centroids.weight.shape == (16, 32)
    assert llm.llm_engine.core.scheduler.spec_stats.num_drafts > 0


def test_centroid_ordering_must_be_a_permutation(tiny_gemma3_dir, tmp_path):
    import json
    import os

    from safetensors.torch import load_file, save_file

    head = write_mtp_head(str(tmp_path / "mtp_bad"), tiny_gemma3_dir, seed=6, centroids=(16, 4))
    f = os.path.join(head, "model.safetensors")
    W = load_file(f)
    W["masked_embedding.token_ordering"] = torch.zeros(128, dtype=torch.int64)
    save_file(W, f)
    with pytest.raises(ValueError, match="token_ordering"):
        LLM(tiny_gemma3_dir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": 2},
            dtype="float32", num_threads=1, max_model_len=256)
    with open(os.path.join(head, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["num_centroids"] = 7  # does not divide the vocabulary
    with open(os.path.join(head, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(ValueError, match="num_centroids"):
        LLM(tiny_gemma3_dir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": 2},
            dtype="float32", num_threads=1, max_model_len=256)
