"""Speculative decoding counters in /metrics (Prometheus text) and the periodic log line; the
suffix proposer's global cache filled past its bound, as the gauges report it."""
import re

from pagedllm import LLM, SamplingParams
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger

from spec_helpers import tiny_prompts


def _sample(text: str, name: str, **labels) -> float:
    lab = "".join(f'.*{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{{{lab}.*}} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_prometheus_and_log_line(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", num_threads=1, max_model_len=256,
              speculative_config={"method": "suffix", "num_speculative_tokens": 3,
                                  "suffix_decoding_max_cached_requests": 2, "disable_by_batch_size": 0})
    core = llm.llm_engine.core
    prom = PrometheusStatLogger("tiny")
    lines = []
    log = LoggingStatLogger(interval=1e9, log_fn=lines.append)
    prom.record(core.get_scheduler_stats(), None)
    log.record(core.get_scheduler_stats(), None)
    for i, p in enumerate(tiny_prompts(5, seed=7)):  # one by one: each finished output is cached
        llm.generate(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        stats = core.get_scheduler_stats()
        prom.record(stats, None)
        log.record(stats, None)
    st = core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    text = prom.render().decode()
    assert _sample(text, "pagedllm:spec_decode_num_drafts_total") == st.num_drafts
    assert _sample(text, "pagedllm:spec_decode_num_draft_tokens_total") == st.num_draft_tokens
    assert _sample(text, "pagedllm:spec_decode_num_accepted_tokens_total") == st.num_accepted_tokens
    for pos, n in enumerate(st.num_accepted_tokens_per_pos):
        assert _sample(text, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", position=pos) == n
    mean = _sample(text, "pagedllm:spec_decode_mean_acceptance_length")
    assert abs(mean - st.mean_acceptance_length) < 1e-9 and mean > 1.0
    # Five finished requests through a cache bounded at two.
    assert _sample(text, "pagedllm:spec_decode_suffix_cached_requests") == 2
    assert _sample(text, "pagedllm:spec_decode_suffix_cache_capacity") == 2
    sd = core.runner.spec_decoder
    assert _sample(text, "pagedllm:spec_decode_suffix_tree_nodes") == sd.proposer.impl.global_trie.num_nodes > 0
    line = log.log()
    assert f"mean acceptance length {st.mean_acceptance_length:.2f}" in line
    assert f"accepted {st.num_accepted_tokens}/{st.num_draft_tokens} draft tokens" in line


def test_no_spec_metrics_without_speculation(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", num_threads=1, max_model_len=256)
    stats = llm.llm_engine.core.get_scheduler_stats()
    assert not any(k.startswith("spec_decode") for k in stats)
