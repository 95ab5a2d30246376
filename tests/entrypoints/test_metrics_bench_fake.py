"""Stats helpers, stat loggers and the bench-serve client against the fake engine."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx

from pagedllm.entrypoints.bench_serve import (add_bench_serve_args, benchmark, format_results,
                                              synthetic_prompts)
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
