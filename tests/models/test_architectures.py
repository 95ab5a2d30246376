"""Every native architecture, and two through the transformers fallback, vs transformers on a tiny random
checkpoint saved as safetensors (``tests/arch_cases.py``): loaded through ``pagedllm.loader``,

- fp32 logits within 1e-4 of transformers' for a prefill, decodes and a chunked prefill;
- through ``LLM`` (chunked prefill: 8-token budget, prefix caching on, 4-token blocks): greedy tokens
  identical to transformers' ``generate`` over 3 prompts x 16 tokens, and each sampled token's
  logprob within 1e-4 of transformers' log-softmax.
"""
from __future__ import annotations

import pytest
import torch
from arch_cases import CASES, NEW, PROMPT, PROMPTS, hf_greedy, make_checkpoint
from test_tiny_models import Runner

from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model
from pagedllm.models.registry import get_model_class

torch.set_num_threads(1)
MORE = [11, 50, 93]
_CKPTS: dict = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(case) -> (directory, transformers model)``, built once per module."""
    def get(case):
        if case not in _CKPTS:
            path = str(tmp_path_factory.mktemp(case))
            _CKPTS[case] = (path, make_checkpoint(case, path))
        return _CKPTS[case]
    return get


def load_ours(path, model_impl="auto"):
    lm = load_model(path, dtype=torch.float32)
    model = get_model_class(lm.hf_config.architectures, model_impl, lm.hf_config)(lm.hf_config, torch.float32)
    model.load_weights(lm.weights())
    return model.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, checkpoint):
    path, hf = checkpoint(case)
    ours = load_ours(path)
    r = Runner(ours)
    logits = r.step([("a", PROMPT)])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)
    seq = list(PROMPT)
    for tok in MORE:
        seq.append(tok)
        torch.testing.assert_close(r.step([("a", [tok])])[0], hf_logits(hf, seq)[-1], atol=1e-4, rtol=1e-4)
    chunked = Runner(ours)
    parts = torch.cat([chunked.step([("b", PROMPT[:5])]), chunked.step([("b", PROMPT[5:])])])
    torch.testing.assert_close(parts, logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(case, checkpoint):
    path, hf = checkpoint(case)
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=8, max_num_seqs=3,
              kv_cache_memory=2 * 1024**2, enable_prefix_caching=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    outs = first + llm.generate(prompts, params, use_tqdm=False)
    sched = llm.llm_engine.core.scheduler
    assert sched.prefix_cache_hits > 0
    for ids, out in zip(PROMPTS[:1] + PROMPTS, outs):
        toks, logps = hf_greedy(hf, ids)
        got = out.outputs[0]
        assert list(got.token_ids) == toks
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, toks)]
        assert ours == pytest.approx(logps, abs=1e-4)


def test_dynamic_ntk_rope_past_max_position_embeddings():
    """dynamic NTK past ``max_position_embeddings``: each decoded token matches transformers generating
    with its KV cache (which grows the rope base with the sequence at every step)."""
    import arch_cases

    cls_name, factory = CASES["llama-dynamic"]
    config = factory()
    config.max_position_embeddings = 8
    hf = arch_cases.build_hf(config, cls_name)
    ours = get_model_class([cls_name])(config, torch.float32)
    ours.load_weights(hf.state_dict().items())
    r = Runner(ours, num_blocks=16)
    ids = PROMPT[:6]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        torch.testing.assert_close(r.step([("a", ids)]), out.logits[0], atol=1e-4, rtol=1e-4)
        cache = out.past_key_values
        for tok in PROMPT[6:] + MORE + [9, 8, 7]:  # positions 6 .. 17: past 8 from position 8 on
            out = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            torch.testing.assert_close(r.step([("a", [tok])])[0], out.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_longrope_factors_follow_max_model_len(checkpoint):
    """Phi-3 longrope (original length 8): long factors when max_model_len > 8 (the engine default
    here), short ones with max_model_len <= 8, as vLLM; each matches transformers on sequences it
    rotates the same way (a 6-token prompt is short there, a 12-token one long)."""
    from pagedllm.models.rope import set_rope_max_model_len

    path, hf = checkpoint("phi3")
    ours = load_ours(path)
    rotary = ours.model.rotary
    assert torch.equal(rotary.inv_freq, rotary.long_rope[1])
    torch.testing.assert_close(Runner(ours).step([("a", PROMPT)]), hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)
    assert set_rope_max_model_len(ours, 8) == 1 and torch.equal(rotary.inv_freq, rotary.long_rope[0])
    short = Runner(ours).step([("a", PROMPT[:6])])
    torch.testing.assert_close(short, hf_logits(hf, PROMPT[:6]), atol=1e-4, rtol=1e-4)
    set_rope_max_model_len(ours, 64)
    assert (Runner(ours).step([("a", PROMPT[:6])]) - short).abs().max() > 1e-3
    llm = LLM(path, dtype="float32", max_model_len=8, block_size=4, kv_cache_memory=2 * 1024**2)
    out = llm.generate([{"prompt_token_ids": PROMPT[:6]}], SamplingParams(temperature=0, max_tokens=2,
                                                                         ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, PROMPT[:6], 2)[0]
