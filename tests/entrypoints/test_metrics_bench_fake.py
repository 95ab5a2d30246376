"""Stats helpers, stat loggers and the bench-serve client against the fake engine."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx

from pagedllm.entrypoints.bench_serve import (MIXED_KINDS, add_bench_serve_args, benchmark, format_results,
                                              mixed_requests, synthetic_prompts)
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats, RequestStateStats, SchedulerStats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeAsyncLLM  # noqa: E402


def test_request_state_stats():
    it = IterationStats()
    r = RequestStateStats()
    r.observe(it, arrival_time=10.0, first_scheduled_time=10.5, now=11.0, num_new_tokens=1,
              is_first_token=True, num_prompt_tokens=7)
    assert it.time_to_first_tokens_iter == [1.0] and it.num_prompt_tokens == 7
    it2 = IterationStats()
    r.observe(it2, 10.0, 10.5, 11.25, 1, False)
    r.observe(it2, 10.0, 10.5, 11.5, 1, False, finished_reason="length")
    assert it2.inter_token_latencies_iter == [0.25, 0.25]
    (f,) = it2.finished_requests
    assert (f.finish_reason, f.e2e_latency, f.queue_time) == ("length", 1.5, 0.5)
    assert (f.num_prompt_tokens, f.num_generation_tokens) == (7, 3)
    assert it2.num_generation_tokens == 2 and it2.num_prompt_tokens == 0


def test_prometheus_accepts_dict_and_dataclass():
    p = PrometheusStatLogger("m", 128)
    p.record({"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5,
              "num_preemptions_total": 3, "prefix_cache_queries": 10, "prefix_cache_hits": 4},
             None)
    p.record({"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
              "num_preemptions_total": 3, "prefix_cache_queries": 30, "prefix_cache_hits": 4},
             None)
    text = p.render().decode()
    assert 'pagedllm:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'pagedllm:prefix_cache_queries_total{model_name="m"} 30.0' in text
    assert 'pagedllm:prefix_cache_hits_total{model_name="m"} 4.0' in text
    p.record(SchedulerStats(1, 0, 0.25), IterationStats(num_prompt_tokens=5,
                                                         num_generation_tokens=2))
    text = p.render().decode()
    assert 'pagedllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'pagedllm:prompt_tokens_total{model_name="m"} 5.0' in text


def test_logging_stat_logger():
    lines = []
    lg = LoggingStatLogger(interval=1000, log_fn=lines.append)
    lg.record(SchedulerStats(3, 2, 0.5, prefix_cache_queries=10, prefix_cache_hits=5),
              IterationStats(num_prompt_tokens=100, num_generation_tokens=10))
    assert not lines
    line = lg.log()
    assert line is not None and lines == [line]
    assert line.startswith("Avg prompt throughput: ")
    assert "Avg generation throughput: " in line and "Running: 3 reqs, Waiting: 2 reqs" in line
    assert "KV cache usage: 50.0%" in line and "Prefix cache hit rate: 50.0%" in line


def test_bench_serve_against_fake():
    engine = FakeAsyncLLM(max_model_len=256)
    app = build_app(engine, argparse.Namespace(disable_log_requests=True, disable_log_stats=True))
    args = add_bench_serve_args(argparse.ArgumentParser()).parse_args(
        ["--num-prompts", "4", "--max-tokens", "5", "--input-len", "8", "--max-concurrency", "2"])
    args.transport = httpx.ASGITransport(app=app)
    args.base_url = "http://testserver"
    m = asyncio.run(benchmark(args))
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 20 and m["total_input_tokens"] > 0
    out = format_results(m, 2, float("inf"))
    for key in ("Successful requests:", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
                "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):"):
        assert key in out
    assert synthetic_prompts(3, 10, 0) == synthetic_prompts(3, 10, 0)


def test_bench_serve_chat_endpoint_sends_messages():
    """``--backend openai-chat`` (vLLM's name) or a chat path: each prompt is one user message, and
    TTFT / TPOT come from the chat stream's deltas (a completions body there is a 400)."""
    engine = FakeAsyncLLM(max_model_len=256)
    app = build_app(engine, argparse.Namespace(disable_log_requests=True, disable_log_stats=True))
    for argv in (["--backend", "openai-chat"], ["--endpoint", "/v1/chat/completions"]):
        args = add_bench_serve_args(argparse.ArgumentParser()).parse_args(
            argv + ["--num-prompts", "3", "--max-tokens", "4", "--input-len", "8", "--max-concurrency", "1"])
        args.transport = httpx.ASGITransport(app=app)
        args.base_url = "http://testserver"
        m = asyncio.run(benchmark(args))
        assert m["failed"] == 0, [e for e in m["errors"] if e][:3]
        assert m["completed"] == 3 and m["total_output_tokens"] == 12
        assert m["median_ttft_ms"] > 0 and m["median_tpot_ms"] > 0


def _sample(text: str, name: str) -> float:
    """The value of the exposition line for ``name`` (with its labels)."""
    vals = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.rsplit(" ", 1)[0] == name]
    assert len(vals) == 1, (name, vals)
    return vals[0]


def test_memory_gauges_and_log_line():
    p = PrometheusStatLogger("m", 128)
    p.record_memory({"resident_memory_bytes": 5, "cpu_allocator_cached_bytes": 3 << 20,
                     "cpu_allocator_live_bytes": 7 << 20, "cpu_allocator_cache_limit_bytes": 1 << 30})
    text = p.render().decode()
    assert _sample(text, 'pagedllm:cpu_allocator_cached_bytes{model_name="m"}') == 3 << 20
    assert _sample(text, 'pagedllm:cpu_allocator_live_bytes{model_name="m"}') == 7 << 20
    assert _sample(text, 'pagedllm:cpu_allocator_cache_limit_bytes{model_name="m"}') == 1 << 30
    # This test process's RSS, from prometheus_client's ProcessCollector.
    assert _sample(text, "process_resident_memory_bytes") > 10 << 20
    lines = []
    lg = LoggingStatLogger(interval=1000, log_fn=lines.append,
                           memory_fn=lambda: {"resident_memory_bytes": 3 << 30, "cpu_allocator_cached_bytes": 64 << 20})
    line = lg.log()
    assert line.endswith(", Resident memory: 3.00 GiB, CPU allocator cache: 64.0 MiB"), line
    broken = LoggingStatLogger(interval=1000, log_fn=lines.append, memory_fn=lambda: 1 / 0)
    assert "Resident memory" not in broken.log()  # a failed reading never stops the line


def test_kv_cache_committed_gauge_and_log_line():
    """Issue 30: the KV cache's committed bytes beside the reserved ones."""
    p = PrometheusStatLogger("m", 128)
    p.record_memory({"kv_cache_bytes": 2 << 30, "kv_cache_committed_bytes": 96 << 20})
    text = p.render().decode()
    assert _sample(text, 'pagedllm:kv_cache_bytes{model_name="m"}') == 2 << 30
    assert _sample(text, 'pagedllm:kv_cache_committed_bytes{model_name="m"}') == 96 << 20
    lg = LoggingStatLogger(interval=1000, log_fn=[].append,
                           memory_fn=lambda: {"resident_memory_bytes": 1 << 30, "kv_cache_bytes": 2 << 30,
                                              "kv_cache_committed_bytes": 96 << 20})
    assert lg.log().endswith(", Resident memory: 1.00 GiB, KV cache committed: 96.0 MiB of 2.00 GiB")


def test_server_metrics_carry_memory_and_mixed_soak_samples_it():
    engine = FakeAsyncLLM(max_model_len=4096)
    app = build_app(engine, argparse.Namespace(disable_log_requests=True, disable_log_stats=True))
    args = add_bench_serve_args(argparse.ArgumentParser()).parse_args(
        ["--dataset-name", "mixed", "--num-prompts", "16", "--max-tokens", "4", "--max-concurrency", "4",
         "--warmup-requests", "8", "--memory-samples", "2"])
    args.transport = httpx.ASGITransport(app=app)
    args.base_url = "http://testserver"
    m = asyncio.run(benchmark(args))
    assert m["failed"] == 0, [e for e in m["errors"] if e][:3]
    assert m["completed"] == 16
    assert [s["requests_done"] for s in m["memory_samples"]] == [8, 12, 16]  # after warm-up, then 2
    assert all(s["resident_memory_bytes"] > 10 << 20 for s in m["memory_samples"])
    assert "resident_memory_growth_ratio" in m

    async def scrape():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/metrics")).text
    text = asyncio.run(scrape())
    assert _sample(text, f'pagedllm:cpu_allocator_cached_bytes{{model_name="{m["model_id"]}"}}') == 64 << 20


def test_mixed_workload_is_deterministic_and_covers_every_kind():
    a = mixed_requests(24, 3, 8)
    assert a == mixed_requests(24, 3, 8) and a != mixed_requests(24, 4, 8)
    endpoints = {e for e, _, _ in a}
    assert endpoints == {"/v1/chat/completions", "/v1/completions"}
    assert sum(abort for _, _, abort in a) == 24 // len(MIXED_KINDS)
    assert any(not body["stream"] for _, body, _ in a)
    assert any(len(body.get("prompt", "")) > 4000 for _, body, _ in a)
    assert any("seed" in body for _, body, _ in a) and any(body.get("logprobs") == 5 for _, body, _ in a)
    short = mixed_requests(24, 3, 8, long_prompt_chars=1000)
    longest = max(len(body.get("prompt", "")) for _, body, _ in short) - len("\nSummary:")
    assert 900 < longest <= 1000, longest


def test_bench_serve_json_schema_on_a_share_of_requests():
    from pagedllm.entrypoints.bench_serve import BUILTIN_SCHEMA
    engine = FakeAsyncLLM(max_model_len=256)
    app = build_app(engine, argparse.Namespace(disable_log_requests=True, disable_log_stats=True))
    args = add_bench_serve_args(argparse.ArgumentParser()).parse_args(
        ["--num-prompts", "6", "--max-tokens", "4", "--input-len", "8", "--max-concurrency", "3",
         "--json-schema", "builtin", "--structured-output-ratio", "0.5"])
    args.transport = httpx.ASGITransport(app=app)
    args.base_url = "http://testserver"
    m = asyncio.run(benchmark(args))
    assert m["completed"] == 6 and m["structured_outputs"] == 3
    sos = [sp.structured_outputs for _, sp, _ in engine.received]
    assert sum(so is not None for so in sos) == 3
    assert all(so.json == BUILTIN_SCHEMA for so in sos if so is not None)
    assert len(BUILTIN_SCHEMA["properties"]) == 20
    # The fake engine ignores the constraint: its text is no JSON, so none counts as valid.
    assert m["structured_outputs_valid"] == 0
    assert "Structured-output requests:" in format_results(m, 3, float("inf"))


def test_bench_hardware_sizes_its_matmuls(monkeypatch):
    """``measure_hardware``: every figure is there and positive; a matmul stops growing once one
    call takes ``_MATMUL_GROW_S`` (0 here: n stays 256; a CPU without native bf16 stops this way
    instead of running a 2048^3 bf16 matmul for minutes), else it grows to ``_MATMUL_MAX_N``."""
    from pagedllm.entrypoints import bench

    monkeypatch.setattr(bench, "_MATMUL_GROW_S", 0.0)
    res = bench.measure_hardware(1)
    assert res["threads"] == 1
    assert res["matmul_fp32_n"] == 256 and res["matmul_bf16_n"] == 256
    for k in ("matmul_fp32_gflops", "matmul_bf16_gflops", "read_bandwidth_gbps", "copy_bandwidth_gbps"):
        assert res[k] > 0, (k, res)
    monkeypatch.setattr(bench, "_MATMUL_GROW_S", float("inf"))
    monkeypatch.setattr(bench, "_MATMUL_MAX_N", 512)
    assert bench.measure_hardware(1)["matmul_fp32_n"] == 512
