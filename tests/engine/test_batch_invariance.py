"""Batch-invariant mode (issue 16 part 2): a request's logits and logprobs have the same bits
whatever else the engine did: the other requests of each step, where its prefill was split,
K/V from the prefix cache, preemption and recompute, thread count.

Two levels, both property tests over random schedules that compare bits, not tokens:
* model level: tiny random models of every architecture driven through a paged cache by a random
  scheduler (batch mixes, chunk splits, shared prefix blocks, preemption), every logit row
  compared with the request computed alone in one prefill;
* engine level: ``LLM(batch_invariant=True)`` on a tiny random checkpoint, a prompt alone vs after
  a sibling that shares its prefix vs inside batches with chunked prefill and preemption:
  generated tokens, top-20 logprobs and prompt logprobs identical to the last bit.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import transformers as tf

from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.attention.torch_paged import build_metadata
from pagedllm.models.registry import get_model_class

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256)
BS = 4  # block size of the model-level runs


def _config(arch):
    if arch == "LlamaForCausalLM":
        return tf.LlamaConfig(**COMMON, num_key_value_heads=2, rms_norm_eps=1e-5)
    if arch == "Qwen2ForCausalLM":
        return tf.Qwen2Config(**COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"])
    if arch == "Qwen3ForCausalLM":
        return tf.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True)
    return tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=1, head_dim=32,
                               sliding_window=6, query_pre_attn_scalar=24, final_logit_softcapping=10.0,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _model(arch, dtype):
    """Our model with big random weights (so attention and norms matter), batch-invariant."""
    from pagedllm.worker.batch_invariant import enable_batch_invariant

    torch.manual_seed(0)
    config = _config(arch)
    model = get_model_class([arch])(config, dtype)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.15)
    enable_batch_invariant(model.eval())
    return model


class _PagedRun:
    """A paged KV cache and the model over it: ``step([(table, start, tokens), ...])``."""

    def __init__(self, model, dtype, num_blocks=400):
        from pagedllm.attention.batch_invariant import BatchInvariantAttention

        n_layers, hkv, d = model.get_kv_cache_spec()
        self.model, self.attn = model, BatchInvariantAttention()
        self.caches = [torch.zeros(num_blocks, 2, BS, hkv, d, dtype=dtype) for _ in range(n_layers)]
        self.free = list(range(num_blocks))
        random.Random(num_blocks).shuffle(self.free)

    def alloc(self, table, n_tokens):
        while len(table) * BS < n_tokens:
            table.append(self.free.pop())

    def step(self, items):
        """items: (table, start, tokens), one-token items first -> float32 logits per item."""
        meta = build_metadata([(start, len(toks), table) for table, start, toks in items], BS)
        ids = torch.tensor([t for _, _, toks in items for t in toks])
        pos = torch.tensor([p for _, start, toks in items for p in range(start, start + len(toks))])
        with torch.inference_mode(), set_forward_context(ForwardContext(meta, self.caches, self.attn)):
            logits = self.model.compute_logits(self.model(ids, pos))
        out, at = [], 0
        for _, _, toks in items:
            out.append(logits[at : at + len(toks)])
            at += len(toks)
        return out


def _fuzz(model, dtype, seed, n_requests=6):
    """Random requests (some sharing a prefix with an earlier one) run alone, then under a random
    schedule; returns how many logit rows were compared (all equal, else AssertionError)."""
    rng = random.Random(seed)
    run = _PagedRun(model, dtype)
    seqs, parents = [], []
    for i in range(n_requests):
        n = rng.randrange(3, 40)
        if i and rng.random() < 0.5:  # shares a prefix of whole blocks with an earlier request
            j = rng.randrange(i)
            share = min(len(seqs[j]), rng.randrange(1, 6) * BS)
            seqs.append(seqs[j][:share] + [rng.randrange(96) for _ in range(n)])
            parents.append((j, share // BS))
        else:
            seqs.append([rng.randrange(96) for _ in range(n)])
            parents.append(None)
    ref = []
    for s in seqs:  # each alone, one prefill
        table: list[int] = []
        run.alloc(table, len(s))
        ref.append(run.step([(table, 0, s)])[0])
    state = [{"table": [], "pos": 0} for _ in seqs]
    compared = 0
    while any(st["pos"] < len(s) for st, s in zip(state, seqs)):
        live = [i for i, (st, s) in enumerate(zip(state, seqs)) if st["pos"] < len(s)]
        chosen = rng.sample(live, rng.randrange(1, min(4, len(live)) + 1))
        items, owners = [], []
        for i in chosen:
            st, s = state[i], seqs[i]
            if st["pos"] > 0 and rng.random() < 0.1:  # preempted: blocks dropped, recomputed later
                st["table"], st["pos"] = [], 0
                continue
            if st["pos"] == 0 and parents[i] is not None:  # prefix-cache hit on the parent's blocks
                j, nblk = parents[i]
                pst = state[j]
                hit = min(nblk, pst["pos"] // BS, (len(s) - 1) // BS)
                if hit:
                    st["table"], st["pos"] = list(pst["table"][:hit]), hit * BS
            n = 1 if rng.random() < 0.4 else rng.randrange(1, 13)
            toks = s[st["pos"] : st["pos"] + n]
            run.alloc(st["table"], st["pos"] + len(toks))
            items.append((st["table"], st["pos"], toks))
            owners.append((i, st["pos"], len(toks)))
            st["pos"] += len(toks)
        if not items:
            continue
        order = sorted(range(len(items)), key=lambda k: len(items[k][2]) != 1)  # decodes first
        outs = run.step([items[k] for k in order])
        for k, out in zip(order, outs):
            i, start, n = owners[k]
            assert torch.equal(out, ref[i][start : start + n]), (i, start, n)
            compared += n
    return compared


@pytest.mark.parametrize("arch,dtype", [("LlamaForCausalLM", torch.float32), ("LlamaForCausalLM", torch.bfloat16),
                                        ("Qwen2ForCausalLM", torch.float32), ("Qwen3ForCausalLM", torch.float32),
                                        ("Gemma3ForCausalLM", torch.float32), ("Gemma3ForCausalLM", torch.bfloat16)])
def test_model_logits_bitwise_under_random_schedules(arch, dtype):
    model = _model(arch, dtype)
    compared = sum(_fuzz(model, dtype, seed) for seed in range(3))
    assert compared > 100


def test_model_logits_bitwise_on_two_threads():
    model = _model("LlamaForCausalLM", torch.float32)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _fuzz(model, torch.float32, seed=11) > 0
    finally:
        torch.set_num_threads(old)


def test_batch_invariant_model_is_close_to_default():
    """The invariant kernels compute the same function: logits within float32 rounding of the
    default path's (alone, one prefill)."""
    from pagedllm.attention.torch_paged import TorchPagedAttention

    model = _model("Qwen3ForCausalLM", torch.float32)
    default = get_model_class(["Qwen3ForCausalLM"])(_config("Qwen3ForCausalLM"), torch.float32)
    default.load_state_dict(model.state_dict())
    toks = list(range(5, 45))
    run = _PagedRun(model, torch.float32)
    table: list[int] = []
    run.alloc(table, len(toks))
    got = run.step([(table, 0, toks)])[0]
    meta = build_metadata([(0, len(toks), table)], BS)
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, run.caches, TorchPagedAttention())):
        want = default.compute_logits(default(torch.tensor(toks), torch.arange(len(toks))))
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


# ------------------------------------------------------------------ engine level


@pytest.fixture(scope="module")
def tiny_dir(tiny_smollm2_llama_dir):
    """A tiny random LlamaForCausalLM checkpoint with SmolLM2's tokenizer (vocab 49152)."""
    return tiny_smollm2_llama_dir


BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers * K/V * kv heads * head_dim * float32 * block_size 16


def _sig(out):
    c = out.outputs[0]
    lps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in c.logprobs]
    plps = [None if d is None else sorted((t, lp.logprob) for t, lp in d.items()) for d in out.prompt_logprobs or []]
    return c.token_ids, lps, plps


def test_engine_outputs_bitwise_alone_sibling_batch_chunked_preempted(tiny_dir):
    from pagedllm import LLM, SamplingParams

    rng = random.Random(0)
    doc = [rng.randrange(100, 40000) for _ in range(70)]
    target = {"prompt_token_ids": doc + [rng.randrange(100, 40000) for _ in range(9)]}
    sibling = {"prompt_token_ids": doc + [rng.randrange(100, 40000) for _ in range(5)]}
    others = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(5, 60))]}
              for _ in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=20, prompt_logprobs=5, ignore_eos=True)
    no_prompt_lps = SamplingParams(temperature=0, max_tokens=12, logprobs=20, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    big = LLM(tiny_dir, dtype="float32", batch_invariant=True, kv_cache_memory=400 * BLOCK_BYTES,
              max_num_batched_tokens=512, seed=0)
    alone = _sig(big.generate(target, sp, use_tqdm=False)[0])
    assert len(alone[1]) == 12 and all(len(d) >= 20 for d in alone[1])
    # after a sibling that shares the document: prefix-cache hit (a request asking for prompt
    # logprobs never reads the prefix cache, as in vLLM, so this one asks for logprobs only)
    big.generate(sibling, short, use_tqdm=False)
    hit = big.generate(target, no_prompt_lps, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 64
    assert _sig(hit)[:2] == alone[:2]
    # in a batch with other requests, before and after it
    assert big.reset_prefix_cache()
    outs = big.generate(others[:2] + [target] + others[2:], [short, short, sp, short, short, short], use_tqdm=False)
    assert _sig(outs[2]) == alone

    # chunked prefill (16-token budget) and a cache so small that requests are preempted
    small = LLM(tiny_dir, dtype="float32", batch_invariant=True, kv_cache_memory=12 * BLOCK_BYTES,
                max_model_len=160, max_num_batched_tokens=16, seed=0)
    outs = small.generate([sibling, target] + others, [sp, sp] + [sp] * len(others), use_tqdm=False)
    assert _sig(outs[1]) == alone
    assert small.llm_engine.core.scheduler.num_preemptions_total > 0


def test_engine_env_switch_and_refused_settings(tiny_dir, monkeypatch):
    from pagedllm import LLM

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory=64 * BLOCK_BYTES)
    worker = llm.llm_engine.core.executor.driver_worker
    assert worker.batch_invariant and type(worker.runner.attn_impl).__name__ == "BatchInvariantAttention"
    assert type(worker.model.model.layers[0].mlp.act_method).__name__ == "BatchInvariantActMul"
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    for kw, field in [({"quantization": "int8"}, "quantization"), ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
                      ({"dtype": "float16"}, "dtype")]:
        with pytest.raises(ValueError, match=f"batch_invariant.*{field}"):
            LLM(tiny_dir, batch_invariant=True, kv_cache_memory=64 * BLOCK_BYTES, **kw)


def test_env_parsing(monkeypatch):
    from pagedllm.kernels.batch_invariant import batch_invariant_from_env

    for var in ("PAGEDLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(var, raising=False)
    assert not batch_invariant_from_env()
    for val, want in [("1", True), ("true", True), ("0", False), ("", False), ("no", False)]:
        monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", val)
        assert batch_invariant_from_env() is want
    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert batch_invariant_from_env()
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
