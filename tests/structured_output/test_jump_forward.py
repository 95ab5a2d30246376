"""Lossless jump-forward structured decoding: the text a grammar forces is proposed as draft
tokens and verified by the model in one forward pass with the grammar's bitmask per position.

* the pieces: forced text and its drafts on SmolLM2's tokenizer (both backends; the matcher is
  left as it was), the per-position bitmask rows, match sampling in the rejection sampler;
* end to end on a tiny random model with SmolLM2's tokenizer (``batch_invariant=True``, so a row's
  logits do not depend on how many rows the step verifies): greedy and seeded outputs identical
  with jump-forward on and off over a set of schemas (fixed keys, enums, nested objects, arrays, a
  named tool call), batched with unconstrained rows and with a speculative method configured;
  fewer engine steps; the counters and their /metrics names; the config switch.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from so_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB, allowed_ids
from tiny_models import save_tiny_llama

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "owner": {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 8},
                                               "is_admin": {"type": "boolean"}},
              "required": ["first_name", "is_admin"]},
    "level": {"enum": ["beginner", "intermediate", "advanced"]}}, "required": ["id", "owner", "level"]}
ARRAY = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"enum": ["crimson", "turquoise"]}, "minItems": 2, "maxItems": 3},
    "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}},
                                          "required": ["x"]}, "minItems": 1, "maxItems": 2}},
    "required": ["colors", "points"]}
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_current_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"]}}}]


def named_tool_call_constraint():
    """The structured output the chat route builds for ``tool_choice`` naming a tool."""
    from pagedllm.entrypoints.openai.tool_calling import (ToolChoice, constrain_to_json,
                                                          forced_tool_schema, validate_tools)
    tools = validate_tools(WEATHER_TOOL)
    sp = SimpleNamespace(structured_outputs=None)
    constrain_to_json(sp, forced_tool_schema(ToolChoice("named", "get_current_weather"), tools, parallel=True),
                      "tool_choice")
    return sp.structured_outputs


def constraints():
    from pagedllm import StructuredOutputsParams as SOP
    return {"fixed_keys": SOP(json=PERSON), "fixed_keys_compact": SOP(json=PERSON, disable_any_whitespace=True),
            "nested_enum": SOP(json=NESTED, disable_any_whitespace=True), "array": SOP(json=ARRAY),
            "tool_call": named_tool_call_constraint(), "choice": SOP(choice=["encyclopedia", "encore"])}


# ----------------------------------------------------------------------------- pieces
@pytest.fixture(scope="module")
def manager(smollm2_tokenizer):
    from pagedllm.structured_output.manager import StructuredOutputManager
    m = StructuredOutputManager(smollm2_tokenizer, SMOLLM2_VOCAB, SMOLLM2_EOS)
    yield m
    m.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_forced_text_becomes_drafts_and_leaves_the_matcher_alone(manager, smollm2_tokenizer, backend):
    from pagedllm import StructuredOutputsParams as SOP
    tok = smollm2_tokenizer
    so = SOP(json=NESTED, disable_any_whitespace=True)
    so._backend = backend
    req = manager.new_request(so)
    req._grammar.result()
    # At the start the grammar forces '{"id":' (compact JSON, "id" first).
    before = allowed_ids(req.matcher, SMOLLM2_VOCAB)
    drafts = req.jump_forward_tokens(16)
    assert tok.decode(drafts) == '{"id":'
    assert drafts == tok.encode('{"id":', add_special_tokens=False)
    assert allowed_ids(req.matcher, SMOLLM2_VOCAB) == before and req.num_accepted == 0
    # after a digit more digits may follow: nothing forced; after the comma the next key, the
    # nested object's first key and the string's opening quote are
    assert req.accept_tokens(drafts + tok.encode("7", add_special_tokens=False))
    assert req.jump_forward_tokens(16) == []
    assert req.accept_tokens(tok.encode(",", add_special_tokens=False))
    assert tok.decode(req.jump_forward_tokens(16)) == '"owner":{"first_name":"'
    assert len(req.jump_forward_tokens(2)) == 2  # the cap
    # a free position (inside the string) forces nothing
    assert req.accept_tokens(req.jump_forward_tokens(16) + tok.encode("Al", add_special_tokens=False))
    assert req.jump_forward_tokens(16) == []


def test_bitmask_rows_per_draft_position(manager, smollm2_tokenizer):
    from pagedllm import StructuredOutputsParams as SOP
    from pagedllm.sample.bitmask import unpack_bitmask
    so = SOP(json=PERSON, disable_any_whitespace=True)
    a, b = manager.new_request(so), manager.new_request(so)
    a._grammar.result()
    drafts = a.jump_forward_tokens(16)
    assert len(drafts) >= 3
    bm = manager.grammar_bitmask([a, b], [drafts, []])
    assert bm.shape == (len(drafts) + 2, (SMOLLM2_VOCAB + 31) // 32)
    rows = unpack_bitmask(bm, SMOLLM2_VOCAB)
    ref = manager.new_request(so)
    for j in range(len(drafts) + 1):  # row j: the allowed tokens after drafts[:j]
        assert rows[j].nonzero().squeeze(1).tolist() == allowed_ids(ref.matcher, SMOLLM2_VOCAB)
        if j < len(drafts):
            assert rows[j][drafts[j]] and ref.accept_tokens([drafts[j]])
    assert torch.equal(rows[len(drafts) + 1], rows[0])  # b: its own single row (the start)
    assert a.num_accepted == 0 and a.accept_tokens(drafts)  # a's matcher rolled back


def test_match_sampling_is_the_step_by_step_sampler():
    """Seeded: the tokens of sampling row by row with the request's generator; unseeded: a draft
    is accepted with probability p(draft)."""
    from pagedllm.sample.metadata import SamplingMetadata
    from pagedllm.sample.rejection_sampler import RejectionSampler
    from pagedllm.sample.sampler import random_sample

    torch.manual_seed(0)
    V, k = 12, 3
    logits = torch.randn(k + 1, V) * 1.5
    probs = torch.softmax(logits, dim=-1)
    rs = RejectionSampler()

    def meta(n=k + 1):
        return SamplingMetadata.from_requests([SimpleNamespace_sp()] * n, [[]] * n, [[]] * n, [None] * n, V)
    for seed in range(40):
        drafts = [int(probs[j].argmax()) if seed % 3 else int(probs[j].argmin()) for j in range(k)]
        g = torch.Generator().manual_seed(seed)
        out = rs(logits, meta(), [drafts], generators={0: g}, match_sampling=[True]).output_token_ids[0]
        g2 = torch.Generator().manual_seed(seed)
        ref = []
        for j in range(k + 1):  # the plain sampler, one step at a time
            t = int(random_sample(probs[j:j + 1], {0: g2})[0])
            ref.append(t)
            if j == k or t != drafts[j]:
                break
        assert out == ref
        assert torch.equal(g.get_state(), g2.get_state())  # the same uniforms consumed
    # unseeded: acceptance of the first draft ~ p(draft) (3 sigma)
    d = int(probs[0].argsort()[-2])
    n = 3000
    acc = sum(rs(logits[:2], meta(2), [[d]], match_sampling=[True]).num_accepted[0] for _ in range(n))
    p = float(probs[0, d])
    assert abs(acc / n - p) < 3 * (p * (1 - p) / n) ** 0.5 + 1e-3


def SimpleNamespace_sp():
    from pagedllm import SamplingParams
    return SamplingParams(temperature=1.0)


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random LlamaForCausalLM with SmolLM2's tokenizer (vocab 49152)."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("jf_tiny")), smollm2_tokenizer, 3, eos_token_id=SMOLLM2_EOS)


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from pagedllm import LLM
    # jump_forward_disable_batch_size 0: drafts in every step, however many requests run
    return LLM(tiny_dir, dtype="float32", batch_invariant=True, seed=0, max_num_batched_tokens=512,
               kv_cache_memory=64 * 1024**2, structured_outputs_config={"jump_forward_disable_batch_size": 0})


def run(llm, prompts, params, jump_forward: bool):
    """(token ids per request, engine steps, jump-forward counter deltas) of one ``generate``."""
    core = llm.llm_engine.core
    sched = core.scheduler
    saved = sched.jump_forward_max_tokens
    sched.jump_forward_max_tokens = saved if jump_forward else 0
    steps = [0]
    step = core.step

    def counted():
        steps[0] += 1
        return step()
    core.step = counted
    before = core.get_scheduler_stats()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.step = step
        sched.jump_forward_max_tokens = saved
    after = core.get_scheduler_stats()
    counts = {k: after[k] - before[k] for k in after if k.startswith("jump_forward_")}
    return [list(o.outputs[0].token_ids) for o in outs], steps[0], counts


def batch(temperature: float, with_free_rows: bool = True):
    from pagedllm import SamplingParams
    prompts, params = [], []
    for i, so in enumerate(constraints().values()):
        prompts.append(f"record number {i}: ")
        params.append(SamplingParams(temperature=temperature, seed=100 + i, max_tokens=48, structured_outputs=so))
    if with_free_rows:
        prompts += ["a free row", "another free row"]
        params += [SamplingParams(temperature=temperature, seed=7, max_tokens=16, ignore_eos=True)] * 2
    return prompts, params


def test_greedy_identical_on_and_off_with_fewer_steps(tiny_llm):
    prompts, params = batch(0.0)
    on, steps_on, c = run(tiny_llm, prompts, params, True)
    off, steps_off, c_off = run(tiny_llm, prompts, params, False)
    assert on == off
    assert c["jump_forward_num_drafts"] > 0 and 0 < c["jump_forward_num_accepted_tokens"] <= c[
        "jump_forward_num_draft_tokens"]
    assert not any(c_off.values())
    assert steps_on < steps_off
    # one request alone: steps drop by the accepted drafts, exactly (one token per plain step)
    one, s1, c1 = run(tiny_llm, prompts[1:2], params[1:2], True)
    ref, s0, _ = run(tiny_llm, prompts[1:2], params[1:2], False)
    assert one == ref and one[0] == on[1]
    assert s0 - s1 == c1["jump_forward_num_accepted_tokens"] > 0


def test_seeded_sampling_identical_on_and_off(tiny_llm):
    """Match sampling draws one uniform per emitted token from the request's generator, as plain
    steps do, so seeded outputs are the same tokens (not only the same distribution)."""
    prompts, params = batch(1.0)
    on, _, c = run(tiny_llm, prompts, params, True)
    off, _, _ = run(tiny_llm, prompts, params, False)
    assert c["jump_forward_num_accepted_tokens"] > 0
    assert on == off


def test_with_a_speculative_method_configured(tiny_dir, tiny_llm):
    """ngram drafts for free rows, grammar drafts for constrained ones, one verification batch."""
    from pagedllm import LLM
    llm = LLM(tiny_dir, dtype="float32", batch_invariant=True, seed=0, max_num_batched_tokens=512,
              kv_cache_memory=64 * 1024**2, structured_outputs_config={"jump_forward_disable_batch_size": 0},
              speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 2, "disable_by_batch_size": 0})
    prompts, params = batch(0.0)
    got, _, c = run(llm, prompts, params, True)
    assert got == run(tiny_llm, prompts, params, False)[0]
    assert c["jump_forward_num_drafts"] > 0
    stats = llm.llm_engine.core.get_scheduler_stats()
    assert stats["spec_decode_num_drafts"] > 0  # the free rows speculated


def test_config_switch_and_metrics(tiny_dir, tiny_llm):
    from pagedllm import LLM
    from pagedllm.metrics.prometheus import PrometheusStatLogger
    from pagedllm.structured_output.config import StructuredOutputsConfig

    off = LLM(tiny_dir, dtype="float32", kv_cache_memory=16 * 1024**2,
              structured_outputs_config={"jump_forward": False})
    assert off.llm_engine.core.scheduler.jump_forward_max_tokens == 0
    assert "jump_forward_num_drafts" not in off.llm_engine.core.get_scheduler_stats()
    assert StructuredOutputsConfig.from_any({"jump_forward_max_tokens": 4}).jump_forward_max_tokens == 4
    for bad in ({"jump_forward": "yes"}, {"jump_forward_max_tokens": 0}):
        with pytest.raises(ValueError, match=r"structured_outputs_config\.jump_forward"):
            StructuredOutputsConfig.from_any(bad)
    prompts, params = batch(0.0, with_free_rows=False)
    _, _, c = run(tiny_llm, prompts[:2], params[:2], True)
    assert c["jump_forward_num_drafts"] > 0
    stats = tiny_llm.llm_engine.core.get_scheduler_stats()
    prom = PrometheusStatLogger("tiny")
    prom.record(stats, None)  # the engine's totals (the first record counts them whole)
    text = prom.render().decode()
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"pagedllm:jump_forward_num_{name}_total{{"))
        assert float(line.rsplit(" ", 1)[1]) == stats[f"jump_forward_num_{name}"] > 0
    assert json.dumps(stats)  # plain numbers


def test_switched_off_in_large_batches(tiny_dir, tiny_llm):
    """With ``jump_forward_disable_batch_size`` N, no grammar drafts are proposed while N or more
    requests run; the tokens are those of step-by-step decoding either way."""
    from pagedllm import LLM
    from pagedllm.structured_output.config import StructuredOutputsConfig

    assert StructuredOutputsConfig().jump_forward_disable_batch_size == 4
    with pytest.raises(ValueError, match=r"structured_outputs_config\.jump_forward_disable_batch_size"):
        StructuredOutputsConfig.from_any({"jump_forward_disable_batch_size": -1})
    prompts, params = batch(0.0)
    ref, _, _ = run(tiny_llm, prompts, params, False)
    n = len(prompts)
    big = LLM(tiny_dir, dtype="float32", batch_invariant=True, seed=0, max_num_batched_tokens=512,
              kv_cache_memory=64 * 1024**2, structured_outputs_config={"jump_forward_disable_batch_size": n})
    sched = big.llm_engine.core.scheduler
    seen: list[tuple[int, int]] = []  # (running requests, requests given grammar drafts) per update
    update = sched.update_from_output

    def spy(so, ro):
        running = len(sched.running)
        out = update(so, ro)
        seen.append((running, sum(1 for r in sched.running if r.spec_token_ids)))
        return out
    sched.update_from_output = spy
    try:
        got, _, c = run(big, prompts, params, True)
    finally:
        sched.update_from_output = update
    assert got == ref
    assert seen and all(d == 0 for r, d in seen if r >= n)
    assert any(r >= n for r, _ in seen)  # the whole batch did run together
