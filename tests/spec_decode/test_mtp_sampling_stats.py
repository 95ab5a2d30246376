"""Seeded sampling through an MTP drafter keeps the target's distribution: the second generated
token's marginal over 4,000 seeded requests (temperature 1, one draft per step, accepted often
because the drafter was trained on the target) passes the rejection sampler tests' chi-square
against the exact marginal computed from the target."""
import os
import sys

import torch

from pagedllm import LLM, SamplingParams

from spec_helpers import target_features, tiny_prompts, train_mtp_head

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sample"))
from test_rejection_sampler import chi_square_pvalue  # noqa: E402

KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


def test_second_token_marginal_matches_the_target(tiny_gemma3_dir, tmp_path):
    base = LLM(tiny_gemma3_dir, **KW)
    model = base.llm_engine.core.runner.model
    train = tiny_prompts(6, seed=41)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in base.generate(train, greedy, use_tqdm=False)]
    head = train_mtp_head(str(tmp_path / "mtp"), tiny_gemma3_dir, model,
                          [p["prompt_token_ids"] + list(o) for p, o in zip(train, outs)],
                          [len(p["prompt_token_ids"]) for p in train], steps=120)
    prompt = train[0]["prompt_token_ids"]
    # Exact marginal of token 2: sum over t1 of p(t1 | prompt) p(t2 | prompt, t1).
    V = 128
    seqs = [prompt] + [prompt + [t] for t in range(V)]
    feats = target_features(model, seqs)
    with torch.inference_mode():
        p1 = model.compute_logits(feats[0][0][-1:]).softmax(-1)[0].double()
        p2 = torch.stack([model.compute_logits(f[0][-1:]).softmax(-1)[0] for f in feats[1:]]).double()
    marginal = (p1[:, None] * p2).sum(0)
    llm = LLM(tiny_gemma3_dir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": 2,
                                                   "disable_by_batch_size": 0}, **KW)
    N = 4000
    sps = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(N)]
    got = llm.generate([{"prompt_token_ids": prompt}] * N, sps, use_tqdm=False)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in got]), minlength=V)
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts >= N // 2 and st.num_accepted_tokens > N // 10, st  # the accept path is exercised
    assert chi_square_pvalue(counts, marginal) > 1e-3
    # The same test rejects a wrong distribution (the first token's).
    assert chi_square_pvalue(counts, p1) < 1e-6
