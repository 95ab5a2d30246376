"""``pagedllm bench throughput --null-model``: the host-time report (a smoke run, no timing
asserted), the null model, the profiler's wrappers and the numpy argmax of the greedy sampler."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedllm.entrypoints.host_time import PHASES
from pagedllm.worker.null_model import NullModel


@pytest.mark.parametrize("num_prompts", [1, 5])
def test_null_model_host_time_report(tmp_path, num_prompts):
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "host.json"
    output_len = 9
    rc = main(["bench", "throughput", "--null-model", "--num-prompts", str(num_prompts), "--output-len",
               str(output_len), "--input-len-min", "12", "--input-len-max", "40", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["null_model"] is True and res["num_requests"] == num_prompts
    # Every bench report names the machine and the kernel path it ran.
    m = res["machine"]
    with open("/proc/cpuinfo") as f:
        cpu_flags = set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    assert m["isa_flags"] and set(m["isa_flags"]) <= cpu_flags and m["cpu_count"] >= 1
    assert m["gguf_kernel"] == "group_gemm" or m["gguf_kernel"].startswith("intdot:"), m
    # Every request is admitted in the first step (its prefill samples token 1); then
    # output_len - 1 decode steps, each with every request.
    assert res["num_decode_steps"] == output_len - 1
    assert res["num_steps"] == output_len
    assert res["mean_decode_batch_size"] == num_prompts
    assert res["host_ms_per_decode_step"] > 0 and res["host_cpu_ms_per_decode_step"] >= 0
    phases = res["phases_ms_per_decode_step"]
    assert set(phases) == set(PHASES)
    assert all(v >= 0 for v in phases.values()), phases
    for p in ("schedule", "prepare_inputs", "sample", "update", "detokenize"):
        assert phases[p] > 0, p
    # The phases split the phased pass's step (``other`` is the remainder).
    assert sum(phases.values()) == pytest.approx(res["phased_host_ms_per_decode_step"], rel=1e-6)


def test_null_model_profiler_changes_nothing_and_unwraps():
    from pagedllm import SamplingParams
    from pagedllm.engine.detokenizer import IncrementalDetokenizer
    from pagedllm.entrypoints.bench import build_null_model_llm
    from pagedllm.entrypoints.host_time import HostTimeProfiler

    llm = build_null_model_llm("SmolLM2-135M-Instruct", 3, 20, 6)
    runner = llm.llm_engine.core.runner
    assert isinstance(runner.model, NullModel)
    prompts = [{"prompt_token_ids": [300 + i, 301, 302 + i]} for i in range(3)]
    sp = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["e"])]
    plain = llm.generate(prompts, sp, use_tqdm=False)
    orig_add = IncrementalDetokenizer.__dict__["add_tokens"]
    prof = HostTimeProfiler(llm, phases=True)
    timed = llm.generate(prompts, sp, use_tqdm=False)
    prof.close()
    assert IncrementalDetokenizer.__dict__["add_tokens"] is orig_add
    assert "update" not in vars(runner.input_batch) and "_sample" not in vars(runner)
    assert "step" not in vars(llm.llm_engine)
    for a, b in zip(plain, timed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert len(plain[0].outputs[0].token_ids) == 6
    assert prof.num_decode_steps >= 1 and prof.report()["num_decode_steps"] == prof.num_decode_steps


def test_null_model_logits_shape_and_determinism():
    m = NullModel(64, seed=3, token_range=(10, 20))
    ids, pos = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    h = m(ids, pos)
    assert h.shape == (3, 1) and h.dtype == torch.float32
    lg = m.compute_logits(h)
    assert lg.shape == (3, 64) and lg.dtype == torch.float32
    top = lg.argmax(-1)
    assert ((top >= 10) & (top < 20)).all()
    assert torch.equal(NullModel(64, seed=3, token_range=(10, 20)).compute_logits(h), lg)
    big = m.compute_logits(torch.zeros(500, 1))  # grows the table
    assert big.shape == (500, 64) and torch.equal(big[:3], m.compute_logits(torch.zeros(3, 1)))
    assert m.compute_logits(torch.zeros(0, 1)).shape == (0, 64)


@pytest.mark.parametrize("threads", [1, 8])
def test_row_argmax_matches_torch(threads):
    from pagedllm.sample.sampler import row_argmax

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for shape in [(1, 7), (33, 512), (4, 300_000)]:
            x = torch.randn(*shape, generator=g)
            x[0, 3] = x[0, 5] = x[0].max() + 1  # a tie: the first index wins
            if shape[0] > 2:
                x[2, 1] = float("nan")  # NaN counts as the largest
                x[1, :] = 0.0
            got = row_argmax(x)
            assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), shape
            assert int(got[0]) == 3
        xb = torch.randn(5, 40, generator=g).to(torch.bfloat16)
        assert torch.equal(row_argmax(xb), xb.argmax(dim=-1))
        xs = torch.randn(6, 50, generator=g)[:, ::2]  # a strided view
        assert torch.equal(row_argmax(xs), xs.argmax(dim=-1))
        with torch.inference_mode():
            xi = torch.randn(3, 9)
            assert torch.equal(row_argmax(xi), xi.argmax(dim=-1))
        assert np.array_equal(row_argmax(torch.zeros(2, 4)).numpy(), [0, 0])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("flags,msg", [
    (["--num-prompts", "0"], "argument --num-prompts: expected a positive integer, got '0'"),
    (["--output-len", "1"], "--output-len: must be >= 2 with --null-model"),
    (["--null-model-vocab-size", "-1"], "--null-model-vocab-size: must be >= 0, got -1"),
])
def test_null_model_bad_flags_one_line(capsys, flags, msg):
    from pagedllm.entrypoints.cli import main

    try:
        rc = main(["bench", "throughput", "--null-model", *flags])
    except SystemExit as e:  # (argparse's own checks exit from the parser)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedllm bench throughput: error: " + msg), err


def test_run_batch_first_tokens_and_prefix_cache_hits(tiny_smollm2_llama_dir):
    """``bench.run_batch`` (prefix-caching and image benches): one first-token time per request,
    every request run to its length, and the second submission of the same prompts served from
    the prefix cache (whole 16-token blocks)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench import run_batch
    from pagedllm.sampling_params import RequestOutputKind

    llm = LLM(tiny_smollm2_llama_dir, dtype="float32", kv_cache_memory=16 * 1024**2, seed=0)
    eng = llm.llm_engine
    shared = list(range(100, 140))
    prompts = [{"prompt_token_ids": shared + [7 + i, 9]} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    ttft, cached = run_batch(eng, prompts, sp)
    assert len(ttft) == 3 and all(t >= 0 for t in ttft)
    assert not eng.has_unfinished_requests()
    _, cached_again = run_batch(eng, prompts, sp)
    assert cached_again >= 3 * 32 > cached


@pytest.mark.parametrize("output_len", [1, 3])
def test_bench_latency_report(tiny_smollm2_llama_dir, output_len):
    """``pagedllm bench latency``: TTFT and latency of a real (tiny) model; with one output token there
    is no decode step, so TPOT and decode speed are None (they divided by zero)."""
    import argparse

    from pagedllm.entrypoints.bench import add_latency_parser, run_latency

    p = argparse.ArgumentParser()
    add_latency_parser(p.add_subparsers())
    res = run_latency(p.parse_args(["latency", tiny_smollm2_llama_dir, "--dtype", "float32", "--num-threads", "1",
                                    "--input-len", "24", "--output-len", str(output_len), "--num-iters", "1"]))
    assert res["input_len"] == 24 and res["output_len"] == output_len
    assert res["avg_latency_s"] > 0 and 0 < res["median_ttft_ms"] <= 1000 * res["avg_latency_s"]
    if output_len == 1:
        assert res["median_tpot_ms"] is None and res["decode_tokens_per_s"] is None
    else:
        assert res["median_tpot_ms"] > 0 and res["decode_tokens_per_s"] == pytest.approx(1000 / res["median_tpot_ms"])
