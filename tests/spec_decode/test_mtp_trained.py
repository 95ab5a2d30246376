"""Mechanics that pay: an MTP drafter trained inside the test for a few seconds on the tiny
Gemma 3 target's own greedy continuations (the target's K/V and hidden states computed by
pagedllm itself) is accepted often when served on prompts it was not trained on: mean
acceptance length >= 1.8 at k = 2 (the issue asks 1.5; measured 2.17 here; feeding the first emitted token instead
of the last one drops it to 1.64). The outputs stay identical to the non-speculative engine's."""
from pagedllm import LLM, SamplingParams

from spec_helpers import tiny_prompts, train_mtp_head

KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


def test_trained_mtp_drafter_is_accepted(tiny_gemma3_dir, tmp_path):
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    base = LLM(tiny_gemma3_dir, **KW)
    train = tiny_prompts(12, seed=21)
    outs = [o.outputs[0].token_ids for o in base.generate(train, sp, use_tqdm=False)]
    seqs = [p["prompt_token_ids"] + list(r) for p, r in zip(train, outs)]
    head = train_mtp_head(str(tmp_path / "mtp"), tiny_gemma3_dir, base.llm_engine.core.runner.model, seqs,
                          [len(p["prompt_token_ids"]) for p in train], steps=240)
    held_out = tiny_prompts(12, seed=99)
    ref = [o.outputs[0].token_ids for o in base.generate(held_out, sp, use_tqdm=False)]
    llm = LLM(tiny_gemma3_dir, speculative_config={"method": "mtp", "model": head, "num_speculative_tokens": 2,
                                                   "disable_by_batch_size": 0}, **KW)
    got = [o.outputs[0].token_ids for o in llm.generate(held_out, sp, use_tqdm=False)]
    assert got == ref
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 100
    assert st.mean_acceptance_length >= 1.8, st
