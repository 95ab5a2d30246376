"""The MoE layer (models/moe.py) against transformers' own MoE blocks on the same weights: routing
ties, experts that receive no tokens, every token on one expert, empty batches, the per-expert
loop, bf16, expert-parallel shards, and loading per-expert / stacked checkpoint tensors."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedllm.models.moe import FusedMoE, SparseMoeBlock, expert_param_target, select_experts

torch.set_num_threads(1)
H, I, E = 32, 24, 8


def _mixtral_config(**kw):
    return tf.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2, **kw)


def _randomize(module, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def _ours_from(hf_block, top_k, renormalize, shared=None):
    ours = SparseMoeBlock(H, E, top_k, I if shared is None else hf_block.experts.intermediate_dim, renormalize,
                          shared_intermediate=shared)
    sd = {k: v for k, v in hf_block.state_dict().items()}
    with torch.no_grad():
        ours.gate.weight.copy_(sd.pop("gate.weight"))
        ours.experts.w13_weight.copy_(sd.pop("experts.gate_up_proj"))
        ours.experts.w2_weight.copy_(sd.pop("experts.down_proj"))
        if shared is not None:
            ours.shared_expert_gate.weight.copy_(sd.pop("shared_expert_gate.weight"))
            gate, up = sd.pop("shared_expert.gate_proj.weight"), sd.pop("shared_expert.up_proj.weight")
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([gate, up]))
            ours.shared_expert.down_proj.weight.copy_(sd.pop("shared_expert.down_proj.weight"))
    assert not sd
    return ours


def _hf_experts(seed=0):
    return _randomize(MixtralExperts(_mixtral_config()).eval(), seed)


def _fused_like(hf_experts):
    ours = FusedMoE(E, H, I)
    with torch.no_grad():
        ours.w13_weight.copy_(hf_experts.gate_up_proj)
        ours.w2_weight.copy_(hf_experts.down_proj)
    return ours


@pytest.mark.parametrize("block,renorm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
                                          ("qwen2_moe", False)])
def test_block_matches_transformers(block, renorm):
    torch.manual_seed(1)
    x = torch.randn(37, H)
    if block == "mixtral":
        hf = MixtralSparseMoeBlock(_mixtral_config())
        shared = None
    elif block == "qwen3_moe":
        hf = Qwen3MoeSparseMoeBlock(tf.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                                       num_experts_per_tok=3, norm_topk_prob=renorm))
        shared = None
    else:
        hf = Qwen2MoeSparseMoeBlock(tf.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                                       num_experts_per_tok=2, norm_topk_prob=renorm,
                                                       shared_expert_intermediate_size=40))
        shared = 40
    _randomize(hf.eval())
    ours = _ours_from(hf, hf.gate.top_k, renorm, shared)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)


def test_routing_ties_pick_the_same_experts_as_transformers():
    """Experts 2 and 5 (and 1 and 6) have identical router rows: their probabilities tie exactly, and
    both implementations break the ties the same way (the same ``torch.topk``), so the same experts
    run with the same weights."""
    hf = _randomize(MixtralSparseMoeBlock(_mixtral_config()).eval())
    with torch.no_grad():
        hf.gate.weight[5] = hf.gate.weight[2]
        hf.gate.weight[6] = hf.gate.weight[1]
    ours = _ours_from(hf, 2, True)
    x = torch.randn(64, H)
    with torch.no_grad():
        _, hf_w, hf_ids = hf.gate(x)
        w, ids = select_experts(ours.gate(x), 2, True)
        assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
        probs = torch.softmax(ours.gate(x).float(), -1)
        assert torch.equal(probs[:, 2], probs[:, 5])
        one_of_pair = (ids == 2).any(-1) ^ (ids == 5).any(-1)  # a tie broken inside the top-k boundary
        assert one_of_pair.any() and ((ids == 2).any(-1) & (ids == 5).any(-1)).any()
        torch.testing.assert_close(ours(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)


def _routes(kind: str, t: int, k: int):
    g = torch.Generator().manual_seed(3)
    if kind == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    elif kind == "some_idle":  # experts 0, 3 and 7 receive no tokens
        pool = torch.tensor([1, 2, 4, 5, 6])
        ids = torch.stack([pool[torch.randperm(5, generator=g)[:k]] for _ in range(t)])
    else:  # "one_expert": every token's first choice is expert 4 (k = 1: only expert 4 works)
        ids = torch.stack([torch.cat([torch.tensor([4]), torch.tensor([e for e in torch.randperm(E, generator=g).tolist()
                                                                        if e != 4][:k - 1], dtype=torch.int64)])
                           for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("kind,k", [("random", 2), ("some_idle", 2), ("one_expert", 1), ("one_expert", 3)])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_experts_match_transformers_loop(kind, k, t):
    hf = _hf_experts()
    ours = _fused_like(hf)
    torch.manual_seed(t)
    x = torch.randn(t, H)
    w, ids = _routes(kind, t, k)
    with torch.no_grad():
        ref = hf(x, ids, w)
        got = ours(x, w, ids)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        ours.use_grouped_mm = False  # the per-expert loop gives the same
        torch.testing.assert_close(ours(x, w, ids), got, atol=1e-5, rtol=1e-5)
    if kind == "some_idle":
        assert not torch.isin(ids, torch.tensor([0, 3, 7])).any()


def test_empty_batch_and_bf16():
    hf = _hf_experts()
    ours = _fused_like(hf)
    with torch.no_grad():
        out = ours(torch.empty(0, H), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
        assert out.shape == (0, H)
        x = torch.randn(20, H)
        w, ids = _routes("random", 20, 2)
        ref = hf(x, ids, w)
        ours.to(torch.bfloat16)
        got = ours(x.bfloat16(), w, ids)
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_shards_sum_to_the_layer(world):
    hf = _hf_experts()
    full = _fused_like(hf)
    x = torch.randn(30, H)
    w, ids = _routes("random", 30, 3)
    with torch.no_grad():
        ref = full(x, w, ids)
        total = torch.zeros_like(ref)
        for rank in range(world):
            part = _fused_like(hf)
            part.shard_experts(rank, world)
            assert part.w13_weight.shape[0] == E // world
            total += part(x, w, ids)
            # loading per-expert checkpoint tensors straight into a shard: foreign experts are skipped
            fresh = FusedMoE(E, H, I)
            fresh.shard_experts(rank, world)
            for e in range(E):
                g, u = hf.gate_up_proj[e].chunk(2)
                fresh.w13_weight.weight_loader(fresh.w13_weight, g, (e, 0))
                fresh.w13_weight.weight_loader(fresh.w13_weight, u, (e, 1))
                fresh.w2_weight.weight_loader(fresh.w2_weight, hf.down_proj[e], (e, 0))
            assert torch.equal(fresh.w13_weight, part.w13_weight) and torch.equal(fresh.w2_weight, part.w2_weight)
    torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot be split 3 ways"):
        FusedMoE(E, H, I).shard_experts(0, 3)


def test_tensor_parallel_slices_sum_to_the_layer():
    hf = _hf_experts()
    x = torch.randn(25, H)
    w, ids = _routes("random", 25, 2)
    with torch.no_grad():
        ref = _fused_like(hf)(x, w, ids)
        total = torch.zeros_like(ref)
        for rank in range(3):
            part = _fused_like(hf)
            part.shard_intermediate(rank, 3)
            assert part.w13_weight.shape == (E, 2 * I // 3, H) and part.w2_weight.shape == (E, H, I // 3)
            total += part(x, w, ids)
    torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot be split 5 ways"):
        _fused_like(hf).shard_intermediate(0, 5)


def test_checkpoint_names():
    assert expert_param_target("model.layers.0.mlp.experts.3.up_proj.weight") == (
        "model.layers.0.mlp.experts.w13_weight", (3, 1))
    assert expert_param_target("model.layers.2.mlp.experts.11.w1.weight") == (
        "model.layers.2.mlp.experts.w13_weight", (11, 0))
    assert expert_param_target("model.layers.2.mlp.experts.0.down_proj.weight") == (
        "model.layers.2.mlp.experts.w2_weight", (0, 0))
    assert expert_param_target("model.layers.1.mlp.experts.gate_up_proj") == ("model.layers.1.mlp.experts.w13_weight",
                                                                            None)
    assert expert_param_target("model.layers.1.mlp.shared_expert.gate_proj.weight") is None
    ours = FusedMoE(E, H, I)
    with pytest.raises(ValueError, match="expert 2 shard 1"):
        ours.w13_weight.weight_loader(ours.w13_weight, torch.zeros(I + 1, H), (2, 1))
    with pytest.raises(ValueError, match="stacked experts"):
        ours.w2_weight.whole_loader(ours.w2_weight, torch.zeros(E - 1, H, I))
