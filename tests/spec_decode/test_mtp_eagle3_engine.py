"""MTP (Gemma-4-style assistant reading the target's KV cache) and EAGLE-3 (three target layers'
hidden states) served through the engine on tiny random targets (Gemma 3 with sliding and full
layers; Llama) with random drafters saved in the checkpoint layouts: greedy outputs equal the
non-speculative engine's (alone, batched, chunked prefill with preemption, prefix caching,
n > 1), seeded sampling is reproducible, bad drafter configs fail at start-up naming the field."""
import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams

from spec_helpers import tiny_prompts, write_eagle3_head, write_mtp_head

KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


def spec(method, model, k=3):
    return {"method": method, "model": model, "num_speculative_tokens": k, "disable_by_batch_size": 0}


def gen(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def heads(tiny_gemma3_dir, tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("heads")
    return {
        ("gemma3", "mtp"): write_mtp_head(str(d / "g3_mtp"), tiny_gemma3_dir, seed=1),
        ("gemma3", "eagle3"): write_eagle3_head(str(d / "g3_e3"), tiny_gemma3_dir, seed=2, aux=(0, 2, 3)),
        ("llama", "mtp"): write_mtp_head(str(d / "ll_mtp"), tiny_llama_dir, seed=3, layers=("full_attention",)),
        ("llama", "eagle3"): write_eagle3_head(str(d / "ll_e3"), tiny_llama_dir, seed=4, aux=(0, 1, 1), draft_vocab=96),
    }


@pytest.fixture(scope="module")
def targets(tiny_gemma3_dir, tiny_llama_dir):
    return {"gemma3": tiny_gemma3_dir, "llama": tiny_llama_dir}


@pytest.fixture(scope="module")
def references(targets):
    prompts = tiny_prompts(10, seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return prompts, sp, {name: gen(LLM(path, **KW), prompts, sp) for name, path in targets.items()}


CASES = [("gemma3", "mtp"), ("gemma3", "eagle3"), ("llama", "mtp"), ("llama", "eagle3")]


@pytest.mark.parametrize("target,method", CASES)
def test_greedy_equal_alone_batched_and_prefix_cached(targets, heads, references, target, method):
    prompts, sp, ref = references
    llm = LLM(targets[target], speculative_config=spec(method, heads[target, method]), **KW)
    assert [gen(llm, [p], sp)[0] for p in prompts[:3]] == ref[target][:3]  # alone
    assert gen(llm, prompts, sp) == ref[target]  # batched; the first three now hit the prefix cache
    core = llm.llm_engine.core
    assert core.kv_cache_manager.prefix_cache_stats.hits > 0
    st = core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts


@pytest.mark.parametrize("target,method", CASES)
def test_greedy_equal_with_chunked_prefill_and_preemption(targets, heads, references, target, method):
    prompts, sp, ref = references
    # 40 blocks of 4 tokens (the EAGLE-3 head's own layer included) cannot hold ten requests of
    # 50-90 tokens: preemption; a 16-token budget chunks the prompts.
    layers = {"gemma3": 4, "llama": 2}[target] + (method == "eagle3")
    kw = dict(KW, max_num_batched_tokens=16, block_size=4, kv_cache_memory=40 * 4 * layers * 2 * 2 * 16 * 4,
              enable_prefix_caching=False, max_model_len=128)
    llm = LLM(targets[target], speculative_config=spec(method, heads[target, method], k=2), **kw)
    assert gen(llm, prompts, sp) == ref[target]
    core = llm.llm_engine.core
    assert core.num_blocks == 40
    assert core.scheduler.num_preemptions_total > 0
    assert core.scheduler.spec_stats.num_drafts > 0


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_n_and_seeds(targets, heads, method):
    prompts = tiny_prompts(3, seed=12)
    llm = LLM(targets["gemma3"], speculative_config=spec(method, heads["gemma3", method]), **KW)
    sp = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, n=3, seed=7)
    a = llm.generate(prompts, sp, use_tqdm=False)
    b = llm.generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert len(x.outputs) == 3
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]  # seeded: reproducible
        assert all(len(o.token_ids) == 24 for o in x.outputs)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    base = LLM(targets["gemma3"], **KW)
    g1, g2 = llm.generate(prompts, greedy, use_tqdm=False), base.generate(prompts, greedy, use_tqdm=False)
    assert [[o.token_ids for o in x.outputs] for x in g1] == [[o.token_ids for o in x.outputs] for x in g2]


def _copy_head(src, dst, edit=None, drop=None):
    shutil.copytree(src, dst)
    if edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        edit(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if drop is not None:
        os.remove(os.path.join(dst, drop))
    return dst


def test_bad_drafter_configs_name_the_field(targets, heads, tmp_path):
    g3, ll = targets["gemma3"], targets["llama"]
    m, e = heads["gemma3", "mtp"], heads["gemma3", "eagle3"]
    cases = [
        (g3, "mtp", _copy_head(m, str(tmp_path / "nofiles"), drop="model.safetensors"), "safetensors"),
        (g3, "mtp", _copy_head(m, str(tmp_path / "nocfg"), drop="config.json"), "config.json"),
        (g3, "mtp", str(tmp_path / "absent"), "not a directory"),
        (g3, "mtp", _copy_head(m, str(tmp_path / "hb"), edit=lambda c: c.update(backbone_hidden_size=48)),
         "backbone_hidden_size"),
        (g3, "mtp", _copy_head(m, str(tmp_path / "kv"), edit=lambda c: c["text_config"].update(num_key_value_heads=1)),
         "num_key_value_heads"),
        # The Llama target has no sliding layers for the drafter's sliding layer to read.
        (ll, "mtp", m, "layer_types"),
        (g3, "mtp", _copy_head(m, str(tmp_path / "cent"), edit=lambda c: c.update(
            use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=2)), "masked_embedding"),
        (g3, "eagle3", _copy_head(e, str(tmp_path / "e3h"), edit=lambda c: c.update(target_hidden_size=32)),
         "target_hidden_size"),
        (g3, "eagle3", _copy_head(e, str(tmp_path / "e3aux"), edit=lambda c: c.update(
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]})), "eagle_aux_hidden_state_layer_ids"),
    ]
    for target, method, head, field in cases:
        with pytest.raises(ValueError, match=field):
            LLM(target, speculative_config=spec(method, head), **KW)


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_acceptance_per_method_in_metrics_and_bench(targets, heads, method):
    import argparse
    import re

    from pagedllm.entrypoints.bench import add_latency_parser, run_latency
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    llm = LLM(targets["gemma3"], speculative_config=spec(method, heads["gemma3", method]), **KW)
    core = llm.llm_engine.core
    prom = PrometheusStatLogger("tiny")
    prom.record(core.get_scheduler_stats(), None)
    gen(llm, tiny_prompts(4, seed=13), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stats = core.get_scheduler_stats()
    assert stats["spec_decode_method"] == method
    prom.record(stats, None)
    text = prom.render().decode()
    st = core.scheduler.spec_stats
    for name, want in (("spec_decode_acceptance_rate", st.acceptance_rate),
                       ("spec_decode_method_mean_acceptance_length", st.mean_acceptance_length)):
        m = re.search(rf'^pagedllm:{name}{{.*method="{method}".*}} ([0-9.e+-]+)$', text, re.M)
        assert m and abs(float(m.group(1)) - want) < 1e-9, name
    p = argparse.ArgumentParser()
    add_latency_parser(p.add_subparsers())
    args = p.parse_args(["latency", targets["gemma3"], "--dtype", "float32", "--num-threads", "1",
                         "--input-len", "16", "--output-len", "16", "--num-iters", "1",
                         "--speculative-config", json.dumps(spec(method, heads["gemma3", method]))])
    res = run_latency(args)
    assert res["spec_decode_method"] == method and res["spec_decode_num_drafts"] > 0
    assert 0.0 <= res["spec_decode_acceptance_rate"] <= 1.0 and res["spec_decode_mean_acceptance_length"] >= 1.0


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_lora_target_and_structured_outputs(targets, heads, tmp_path, method, caplog):
    """A LoRA adapter on the target: the drafter reads the adapted target's hidden states / KV and
    the outputs equal the non-speculative LoRA engine's. Grammar-constrained requests do not
    draft (logged once) and come out as without speculation."""
    import logging
    import sys

    from transformers import AutoModelForCausalLM

    from pagedllm import LoRARequest
    from pagedllm import StructuredOutputsParams

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lora"))
    from lora_helpers import make_peft_adapter

    ll = targets["llama"]
    adapter = make_peft_adapter(AutoModelForCausalLM.from_pretrained(ll), str(tmp_path / "ad"), r=8)
    kw = dict(KW, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = tiny_prompts(4, seed=14)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lr = LoRARequest("ad", 1, adapter)
    base = LLM(ll, **kw)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, sp, lora_request=lr, use_tqdm=False)]
    ref_plain = gen(base, prompts, sp)
    assert ref != ref_plain  # the adapter changes the outputs
    llm = LLM(ll, speculative_config=spec(method, heads["llama", method]), **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)] == ref
    assert gen(llm, prompts, sp) == ref_plain
    so = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["w5w6w7", "w9w10"]))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        got = [o.outputs[0].text for o in llm.generate(prompts[:2], so, use_tqdm=False)]
    assert got == [o.outputs[0].text for o in base.generate(prompts[:2], so, use_tqdm=False)]
    # NOTE: the word-level test tokenizer has no decoder for the grammar backend (raw vocab), so
    # these requests can end early on a disallowed token; they must do so exactly as without
    # speculation.
    assert any("off for requests with structured outputs" in r.getMessage() for r in caplog.records)
