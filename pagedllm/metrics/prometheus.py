"""Prometheus metrics with vLLM's names, under the prefix ``pagedllm:`` (default) or ``vllm:``
(``pagedllm serve --metrics-prefix vllm``: existing vLLM dashboards work unchanged).

Each ``PrometheusStatLogger`` owns its own ``CollectorRegistry`` so several servers/engines in
one process never collide. Exposed names (Prometheus adds ``_total`` to counters), ``P`` being
the prefix:

gauges     P:num_requests_running, P:num_requests_waiting, P:kv_cache_usage_perc,
           P:cpu_allocator_cached_bytes, P:cpu_allocator_live_bytes,
           P:cpu_allocator_cache_limit_bytes, P:weight_bytes, P:weight_file_bytes,
           P:weight_mapped_bytes, P:kv_cache_bytes (reserved),
           P:kv_cache_committed_bytes (of which committed: resident on CPU), P:cpu_compute_threads,
           (and prometheus_client's process_* metrics:
           process_resident_memory_bytes, ...), P:structured_output_cache_entries (compiled
           grammars held; at most P:structured_output_cache_capacity),
           P:spec_decode_mean_acceptance_length, P:spec_decode_suffix_cached_requests (finished
           outputs in the suffix proposer's tree; at most P:spec_decode_suffix_cache_capacity),
           P:spec_decode_suffix_tree_nodes, P:spec_decode_acceptance_rate{method} and
           P:spec_decode_method_mean_acceptance_length{method} (since start, per method),
           P:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters} (vLLM's
           info gauge: the current time, one series), P:lora_cpu_cache_adapters (adapters loaded;
           at most P:lora_cpu_cache_capacity); the LoRA ones with --enable-lora only;
           P:kv_events_queue_batches (KV event batches waiting for the publisher thread; at most
           P:kv_events_queue_capacity), with --kv-events-config only
counters   P:prompt_tokens_total, P:generation_tokens_total,
           P:request_success_total{finished_reason}, P:num_preemptions_total,
           P:prefix_cache_queries_total, P:prefix_cache_hits_total,
           P:structured_output_cache_queries_total, P:structured_output_cache_hits_total,
           P:structured_output_compile_failures_total, P:spec_decode_num_drafts_total,
           P:spec_decode_num_draft_tokens_total, P:spec_decode_num_accepted_tokens_total,
           P:spec_decode_num_accepted_tokens_per_pos_total{position},
           P:jump_forward_num_drafts_total, P:jump_forward_num_draft_tokens_total,
           P:jump_forward_num_accepted_tokens_total (jump-forward structured decoding: grammar
           drafts verified, their tokens, the accepted ones),
           P:kv_events_batches_published_total, P:kv_events_batches_dropped_total (batches that
           found the queue full; --kv-events-config only)
histograms P:time_to_first_token_seconds, P:inter_token_latency_seconds,
           P:e2e_request_latency_seconds, P:request_queue_time_seconds,
           P:request_prefill_time_seconds, P:request_decode_time_seconds,
           P:request_inference_time_seconds, P:request_prompt_tokens,
           P:request_generation_tokens, P:request_max_num_generation_tokens,
           P:structured_output_compile_seconds (one observation per grammar compiled)
KV cache tiers (a KV connector such as --kv-offloading-size / --kv-cache-dir; label ``tier``
"host" or "disk"): counters P:kv_tier_hit_blocks_total (blocks found at lookup),
P:kv_tier_load_blocks_total and P:kv_tier_load_bytes_total (copied into the KV cache),
P:kv_tier_save_blocks_total and P:kv_tier_save_bytes_total (stored in the tier),
P:kv_tier_evicted_blocks_total, P:kv_tier_errors_total (unreadable/corrupt/foreign files, failed
writes), P:kv_tier_dropped_blocks_total (not stored: over the bound or the write queue),
P:kv_tier_hit_tokens_total (prompt tokens loaded instead of computed),
P:kv_tier_load_seconds_total (time spent finding and reading blocks); gauges P:kv_tier_blocks,
P:kv_tier_bytes (held now) and P:kv_tier_capacity_bytes (the bound). P2pConnector (disaggregated
prefill/decode) reports tiers "p2p_send" (a producer's staging buffer) and "p2p_recv" (a
consumer), and P:kv_transfer_requests_total{event} (staged, sent, released, expired, evicted,
received, failed, release_sent).
With the ``vllm`` prefix, also vLLM's deprecated names that its example Grafana dashboard
(examples/online_serving/prometheus_grafana/grafana.json) still reads: vllm:gpu_cache_usage_perc
(= kv_cache_usage_perc) and vllm:time_per_output_token_seconds (= inter_token_latency_seconds).
All carry the label ``model_name``.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               ProcessCollector, generate_latest)

from pagedllm.metrics.stats import IterationStats, SchedulerStats, SchedulerStatsAdapter

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
GRAMMAR_COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                           10.0, 30.0]
METRICS_PREFIXES = ("pagedllm", "vllm")


def _token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 buckets up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    mag = 1
    while True:
        for m in (1, 2, 5):
            v = m * mag
            if v > max_model_len:
                return out
            out.append(float(v))
        mag *= 10


def record_scheduler_snapshot(prom: Any, stats: dict) -> None:
    """Refresh the request-count, KV-usage, grammar-cache and LoRA gauges of ``prom`` (a
    ``PrometheusStatLogger``, or one replica's logger in ``metrics.replicas``) from an engine's
    ``get_scheduler_stats()`` dict; called at scrape time, since an idle engine does not step."""
    prom.set_scheduler_gauges(stats.get("num_running", 0), stats.get("num_waiting", 0),
                              stats.get("kv_cache_usage", 0.0))
    prom.gauge_so_entries.set(stats.get("structured_output_cache_entries", 0))
    if "lora_running_adapters" in stats:
        prom.record_lora(stats)


# The metrics labelled by model_name only: (attribute or key, kind, name after the prefix, help[,
# buckets; "tokens" = 1-2-5 buckets up to max_model_len]), registered in this order.
_METRICS: tuple = (
    ("gauge_running", Gauge, "num_requests_running", "Number of requests in model execution batches."),
    ("gauge_waiting", Gauge, "num_requests_waiting", "Number of requests waiting to be processed."),
    ("gauge_kv_usage", Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("counter_preemptions", Counter, "num_preemptions", "Cumulative number of preemption from the engine."),
    ("counter_prompt_tokens", Counter, "prompt_tokens", "Number of prefill tokens processed."),
    ("counter_generation_tokens", Counter, "generation_tokens", "Number of generation tokens processed."),
    ("counter_prefix_queries", Counter, "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("counter_prefix_hits", Counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("hist_ttft", Histogram, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     TTFT_BUCKETS),
    ("hist_itl", Histogram, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     ITL_BUCKETS),
    ("hist_e2e", Histogram, "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     REQUEST_LATENCY_BUCKETS),
    ("hist_queue", Histogram, "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("hist_req_prompt", Histogram, "request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("hist_req_gen", Histogram, "request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("hist_max_gen", Histogram, "request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "tokens"),
    ("hist_prefill", Histogram, "request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    ("hist_decode", Histogram, "request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
    ("hist_inference", Histogram, "request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("counter_so_queries", Counter, "structured_output_cache_queries",
     "Compiled-grammar cache lookups by structured-output requests."),
    ("counter_so_hits", Counter, "structured_output_cache_hits",
     "Structured-output requests whose grammar was already compiled (cache hits)."),
    ("counter_so_failures", Counter, "structured_output_compile_failures",
     "Structured-output constraints no grammar backend could compile."),
    ("gauge_so_entries", Gauge, "structured_output_cache_entries", "Compiled grammars held in the cache."),
    ("gauge_so_capacity", Gauge, "structured_output_cache_capacity", "Most compiled grammars the cache holds (LRU bound)."),
    ("hist_grammar_compile", Histogram, "structured_output_compile_seconds",
     "Histogram of structured-output grammar compile time in seconds.", GRAMMAR_COMPILE_BUCKETS),
    # LoRA (engines with enable_lora): the adapters held in memory.
    ("gauge_lora_cache", Gauge, "lora_cpu_cache_adapters",
     "LoRA adapters loaded in CPU memory (at most lora_cpu_cache_capacity)."),
    ("gauge_lora_capacity", Gauge, "lora_cpu_cache_capacity",
     "Most LoRA adapters kept loaded in CPU memory (max_cpu_loras)."),
    # Speculative decoding (vLLM's vllm:spec_decode_* names) and jump-forward decoding.
    ("counter_spec_drafts", Counter, "spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("counter_spec_draft_tokens", Counter, "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("counter_spec_accepted", Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ("gauge_spec_mean_len", Gauge, "spec_decode_mean_acceptance_length",
     "Mean acceptance length since start: 1 + accepted draft tokens / drafts."),
    ("gauge_suffix_cached", Gauge, "spec_decode_suffix_cached_requests",
     "Finished outputs held in the suffix proposer's global tree."),
    ("gauge_suffix_capacity", Gauge, "spec_decode_suffix_cache_capacity",
     "Most finished outputs the suffix proposer keeps (suffix_decoding_max_cached_requests)."),
    ("gauge_suffix_nodes", Gauge, "spec_decode_suffix_tree_nodes", "Nodes of the suffix proposer's global tree."),
    ("counter_jf_drafts", Counter, "jump_forward_num_drafts",
     "Number of jump-forward drafts (a grammar's forced tokens) verified."),
    ("counter_jf_draft_tokens", Counter, "jump_forward_num_draft_tokens", "Number of jump-forward draft tokens."),
    ("counter_jf_accepted", Counter, "jump_forward_num_accepted_tokens",
     "Number of accepted jump-forward draft tokens."),
)

# Memory gauges (bytes unless said), keyed by their ``get_memory_stats()`` names (``record_memory``).
_MEMORY_GAUGES: tuple = tuple((key, Gauge, key, doc) for key, doc in (
    ("cpu_allocator_cached_bytes",
     "Free blocks the caching CPU allocator keeps for reuse (bounded by its cache limit)."),
    ("cpu_allocator_live_bytes", "Blocks of the caching CPU allocator held by tensors."),
    ("cpu_allocator_cache_limit_bytes", "Cap on the caching CPU allocator's free blocks."),
    ("weight_bytes", "Resident bytes of the model's weights (after quantization and packing)."),
    ("weight_file_bytes", "Bytes of the checkpoint files the weights were read from."),
    ("weight_mapped_bytes", "Bytes of the weights served from the mapped weight cache file "
     "(file-backed, clean pages instead of anonymous copies)."),
    ("kv_cache_bytes", "Bytes of the KV cache (reserved: the block budget)."),
    ("kv_cache_committed_bytes",
     "Bytes of the KV cache committed: blocks handed out since start-up or the last idle "
     "release (on CPU pages become resident on first write; the whole cache on CUDA)."),
    ("cpu_compute_threads", "Engine compute threads now (CPU; fewer while other processes keep "
     "cores busy, PAGEDLLM_THREAD_POLICY)."),
    ("sleep_level", "Sleep mode: 0 awake, else the level the engine sleeps at (1 or 2)."),
    ("sleep_weights_backup_bytes", "Sleep mode level 1: bytes of the weights' copy in the "
     "temporary file (at most the weights' bytes; 0 when awake or at level 2)."),
))

# KV cache events (--kv-events-config), keyed by ``KVEventPublisher.stats()`` names.
_KV_EVENT_METRICS: tuple = (
    ("kv_events_queue_batches", Gauge, "kv_events_queue_batches",
     "KV cache event batches waiting for the publisher thread."),
    ("kv_events_queue_capacity", Gauge, "kv_events_queue_capacity",
     "Most KV cache event batches queued (kv_events_config.max_queue_size); a batch beyond it is dropped."),
    ("kv_events_batches_published_total", Counter, "kv_events_batches_published", "KV cache event batches sent."),
    ("kv_events_batches_dropped_total", Counter, "kv_events_batches_dropped",
     "KV cache event batches dropped because the queue was full."),
)

# The encoder cache (image-text models), keyed by ``get_scheduler_stats()["encoder_cache"]`` names.
_ENCODER_CACHE_METRICS: tuple = (
    ("usage", Gauge, "encoder_cache_usage_tokens", "Image-embedding tokens held in the encoder cache."),
    ("capacity", Gauge, "encoder_cache_capacity_tokens",
     "Most image-embedding tokens the encoder cache holds (encoder_cache_size)."),
    ("queries", Counter, "encoder_cache_queries",
     "Encoder-cache lookups (one per image per chunk that computes its placeholders)."),
    ("hits", Counter, "encoder_cache_hits", "Encoder-cache lookups that found the image's embeddings."),
    ("evictions", Counter, "encoder_cache_evictions", "Encoder-cache entries evicted to stay within the bound."),
)


def _record_totals(metrics: dict[str, Any], seen: dict[str, int], totals: dict[str, Any]) -> None:
    """Bring ``metrics`` (key -> labelled Counter / Gauge) to a component's ``totals`` (key ->
    number; keys absent are left alone): a gauge is set, a counter advances by the difference
    since the last call (``seen`` holds the totals last seen, updated here)."""
    for key, v in totals.items():
        metric, v = metrics[key], int(v)
        if not isinstance(metric, Counter):
            metric.set(v)
            continue
        delta = v - seen.get(key, 0)
        if delta > 0:
            metric.inc(delta)
        seen[key] = v


class PrometheusStatLogger:
    """Stat logger exporting the engine's metrics to a private Prometheus registry."""

    PREFIX = "pagedllm:"

    def __init__(self, model_name: str = "", max_model_len: int = 2048,
                 registry: Optional[CollectorRegistry] = None, prefix: str = "pagedllm"):
        """Args:
            model_name: the ``model_name`` label value.
            max_model_len: upper end of the token-count histograms' buckets.
            registry: the registry to use (default: a private one).
            prefix: "pagedllm" or "vllm" (the metric names' prefix, without the colon).

        Raises:
            ValueError: an unknown prefix.
        """
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix: must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._lock = threading.Lock()
        self._adapt = SchedulerStatsAdapter()
        self.prefix = prefix
        p = prefix + ":"
        labels = ["model_name"]
        reg = self.registry
        # The model_name-labelled metrics as attributes (``_METRICS``), then the collectors and the
        # families with more labels.
        for attr, metric in self._labelled_all(_METRICS, _token_buckets(max(1, int(max_model_len or 1)))).items():
            setattr(self, attr, metric)
        self.kv_tiers = _KVTierCollector(p, model_name)
        reg.register(self.kv_tiers)
        # Memory (bytes), refreshed on every scrape by ``record_memory``; the standard
        # process_resident_memory_bytes etc. come from prometheus_client's ProcessCollector.
        ProcessCollector(registry=reg)
        self.gauge_memory = self._labelled_all(_MEMORY_GAUGES)
        success = Counter(p + "request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=reg)
        self.counter_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._success_family = success
        # vLLM's deprecated names, still read by its example Grafana dashboard.
        self.gauge_gpu_cache = self.hist_tpot = None
        if prefix == "vllm":
            self.gauge_gpu_cache = self._labelled(
                Gauge, "gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage (deprecated: "
                "use vllm:kv_cache_usage_perc).")
            self.hist_tpot = self._labelled(
                Histogram, "time_per_output_token_seconds",
                "Histogram of time per output token in seconds (deprecated: "
                "use vllm:inter_token_latency_seconds).", buckets=ITL_BUCKETS)
        # LoRA (engines with enable_lora): vLLM's info gauge (the adapters held: in _METRICS).
        self.gauge_lora_info = Gauge(p + "lora_requests_info", "Running stats on lora requests.",
                                     labels + ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                     registry=reg)
        self._lora_labels: Optional[tuple] = None
        self._init_spec_decode(p, labels, reg)
        # KV cache events (--kv-events-config); registered on first record_kv_events.
        self._kv_events: Optional[dict] = None
        self._kv_events_seen = {"kv_events_batches_published_total": 0, "kv_events_batches_dropped_total": 0}

    def _labelled(self, kind: type, name: str, doc: str, **kwargs: Any) -> Any:
        """The ``model_name`` child of a new ``kind`` (``Counter`` / ``Gauge`` / ``Histogram``)
        metric ``{prefix}:{name}`` in this logger's registry; ``kwargs`` go to the metric
        (``buckets=...``)."""
        metric = kind(self.prefix + ":" + name, doc, ["model_name"], registry=self.registry, **kwargs)
        return metric.labels(self.model_name)

    def _labelled_all(self, rows: tuple, token_buckets: Optional[list[float]] = None) -> dict[str, Any]:
        """``{key: self._labelled(kind, name, help)}`` for ``(key, kind, name, help[, buckets])`` rows,
        registered in order; buckets ``"tokens"`` are ``token_buckets``."""
        out = {}
        for key, kind, name, doc, *buckets in rows:
            kw = {"buckets": token_buckets if buckets[0] == "tokens" else buckets[0]} if buckets else {}
            out[key] = self._labelled(kind, name, doc, **kw)
        return out

    def _init_spec_decode(self, p: str, labels: list[str], reg: CollectorRegistry) -> None:
        """Speculative decoding's families with more labels (the counters and gauges with
        model_name only, vLLM's ``vllm:spec_decode_*`` names, are in ``_METRICS``)."""
        self._spec_per_pos_family = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels + ["position"], registry=reg)
        self.counter_spec_per_pos: dict[int, Any] = {}
        self._spec_totals = [0, 0, 0]  # drafts, accepted tokens, draft tokens
        # Per method (one per engine): the same totals as ratios, labelled by the method.
        self._spec_rate_family = Gauge(
            p + "spec_decode_acceptance_rate",
            "Accepted / verified draft tokens since start, per speculative method.",
            labels + ["method"], registry=reg)
        self._spec_len_family = Gauge(
            p + "spec_decode_method_mean_acceptance_length",
            "Mean acceptance length since start (1 + accepted draft tokens / drafts), per speculative method.",
            labels + ["method"], registry=reg)

    def _record_spec_decode(self, st: SchedulerStats) -> None:
        if st.jump_forward_num_drafts > 0:
            self.counter_jf_drafts.inc(st.jump_forward_num_drafts)
            self.counter_jf_draft_tokens.inc(st.jump_forward_num_draft_tokens)
            if st.jump_forward_num_accepted_tokens > 0:
                self.counter_jf_accepted.inc(st.jump_forward_num_accepted_tokens)
        if st.spec_decode_num_drafts > 0:
            self.counter_spec_drafts.inc(st.spec_decode_num_drafts)
            self.counter_spec_draft_tokens.inc(st.spec_decode_num_draft_tokens)
            if st.spec_decode_num_accepted_tokens > 0:
                self.counter_spec_accepted.inc(st.spec_decode_num_accepted_tokens)
            self._spec_totals[0] += st.spec_decode_num_drafts
            self._spec_totals[1] += st.spec_decode_num_accepted_tokens
            self._spec_totals[2] += st.spec_decode_num_draft_tokens
            mean = 1.0 + self._spec_totals[1] / self._spec_totals[0]
            self.gauge_spec_mean_len.set(mean)
            if st.spec_decode_method:
                m = (self.model_name, st.spec_decode_method)
                self._spec_len_family.labels(*m).set(mean)
                self._spec_rate_family.labels(*m).set(self._spec_totals[1] / max(1, self._spec_totals[2]))
        for pos, n in enumerate(st.spec_decode_num_accepted_tokens_per_pos):
            c = self.counter_spec_per_pos.get(pos)
            if c is None:
                c = self.counter_spec_per_pos[pos] = self._spec_per_pos_family.labels(self.model_name, str(pos))
            if n > 0:
                c.inc(n)
        if st.spec_decode_suffix_cache_capacity:
            self.gauge_suffix_cached.set(st.spec_decode_suffix_cached_requests)
            self.gauge_suffix_capacity.set(st.spec_decode_suffix_cache_capacity)
            self.gauge_suffix_nodes.set(st.spec_decode_suffix_tree_nodes)

    def set_scheduler_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the request-count and KV-cache-usage gauges (and their deprecated aliases)."""
        self.gauge_running.set(num_running)
        self.gauge_waiting.set(num_waiting)
        self.gauge_kv_usage.set(kv_cache_usage)
        if self.gauge_gpu_cache is not None:
            self.gauge_gpu_cache.set(kv_cache_usage)

    def record(self, scheduler_stats: Optional[SchedulerStats],
               iteration_stats: Optional[IterationStats]) -> None:
        """scheduler_stats: a SchedulerStats, or the engine's totals dict (deltas are taken).
        Preemptions come from iteration_stats.num_preempted, or (without iteration_stats)
        from the dict's num_preemptions_total."""
        with self._lock:
            if isinstance(scheduler_stats, dict) and "lora_running_adapters" in scheduler_stats:
                self._record_lora(scheduler_stats)
            scheduler_stats, preempt = self._adapt(scheduler_stats)
            if iteration_stats is None and preempt:
                self.counter_preemptions.inc(preempt)
            if scheduler_stats is not None:
                self.set_scheduler_gauges(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                                          scheduler_stats.kv_cache_usage)
                if scheduler_stats.prefix_cache_queries > 0:
                    self.counter_prefix_queries.inc(scheduler_stats.prefix_cache_queries)
                if scheduler_stats.prefix_cache_hits > 0:
                    self.counter_prefix_hits.inc(scheduler_stats.prefix_cache_hits)
                self._record_structured_output(scheduler_stats)
                self._record_spec_decode(scheduler_stats)
            if iteration_stats is None:
                return
            if iteration_stats.num_preempted > 0:
                self.counter_preemptions.inc(iteration_stats.num_preempted)
            if iteration_stats.num_prompt_tokens > 0:
                self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
            if iteration_stats.num_generation_tokens > 0:
                self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
            for t in iteration_stats.grammar_compile_seconds:
                self.hist_grammar_compile.observe(t)
            for t in iteration_stats.time_to_first_tokens_iter:
                self.hist_ttft.observe(t)
            for t in iteration_stats.inter_token_latencies_iter:
                self.hist_itl.observe(t)
                if self.hist_tpot is not None:
                    self.hist_tpot.observe(t)
            for fr in iteration_stats.finished_requests:
                c = self.counter_success.get(fr.finish_reason)
                if c is None:
                    c = self._success_family.labels(self.model_name, fr.finish_reason)
                    self.counter_success[fr.finish_reason] = c
                c.inc()
                self.hist_e2e.observe(fr.e2e_latency)
                self.hist_queue.observe(fr.queue_time)
                self.hist_req_prompt.observe(fr.num_prompt_tokens)
                self.hist_req_gen.observe(fr.num_generation_tokens)
                # NOTE: one finished request per sample (n > 1 fans out), so the "max over the
                # request's samples" that vLLM records is each sample's own count here.
                self.hist_max_gen.observe(fr.num_generation_tokens)
                self.hist_prefill.observe(fr.prefill_time)
                self.hist_decode.observe(fr.decode_time)
                self.hist_inference.observe(fr.inference_time)

    def record_memory(self, stats: dict) -> None:
        """Set the memory gauges from ``get_memory_stats()`` (keys absent = allocator not
        installed: those gauges stay 0)."""
        for key, g in self.gauge_memory.items():
            if key in stats:
                g.set(stats[key])

    def record_kv_events(self, stats: dict) -> None:
        """Set the KV-event metrics from ``KVEventPublisher.stats()`` (totals; the counters advance
        by the difference since the last call). The metrics exist from the first call on."""
        with self._lock:
            if self._kv_events is None:
                self._kv_events = self._labelled_all(_KV_EVENT_METRICS)
            _record_totals(self._kv_events, self._kv_events_seen, {k: v for k, v in stats.items()
                                                                   if k in self._kv_events})

    def record_encoder_cache(self, stats: dict) -> None:
        """Set the encoder-cache metrics (image-text models) from ``get_scheduler_stats()["encoder_cache"]``
        (totals; counters advance by the difference): P:encoder_cache_usage_tokens (at most
        P:encoder_cache_capacity_tokens), P:encoder_cache_queries_total, P:encoder_cache_hits_total,
        P:encoder_cache_evictions_total. Registered on the first call."""
        with self._lock:
            ec = getattr(self, "_encoder_cache", None)
            if ec is None:
                ec = self._encoder_cache = self._labelled_all(_ENCODER_CACHE_METRICS)
                self._encoder_cache_seen: dict = {}
            _record_totals(ec, self._encoder_cache_seen, {k: stats.get(k, 0) for k in ec})

    def record_kv_connector(self, stats: Optional[dict]) -> None:
        """Set the KV-tier metrics from ``get_scheduler_stats()["kv_connector"]`` (the
        connector's totals, ``OffloadingConnector.get_kv_connector_stats``)."""
        self.kv_tiers.stats = stats

    def record_lora(self, stats: dict) -> None:
        """Set the LoRA gauges from ``get_scheduler_stats()`` (``lora_running_adapters``,
        ``lora_waiting_adapters``: adapter names; ``max_loras``; ``lora_cpu_cache_adapters``,
        ``max_cpu_loras``)."""
        with self._lock:
            self._record_lora(stats)

    def _record_lora(self, stats: dict) -> None:
        # vLLM sets vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters,
        # max_lora} to the current time; the old label set is removed first, so the family
        # holds one series (vLLM keeps every combination ever seen).
        labels = (self.model_name, str(stats.get("max_loras", 0)), ",".join(stats.get("lora_waiting_adapters", ())),
                  ",".join(stats.get("lora_running_adapters", ())))
        if labels != self._lora_labels:
            self.gauge_lora_info.clear()
            self._lora_labels = labels
        self.gauge_lora_info.labels(*labels).set_to_current_time()
        self.gauge_lora_cache.set(stats.get("lora_cpu_cache_adapters", 0))
        self.gauge_lora_capacity.set(stats.get("max_cpu_loras", 0))

    def _record_structured_output(self, st: SchedulerStats) -> None:
        if st.structured_output_cache_queries > 0:
            self.counter_so_queries.inc(st.structured_output_cache_queries)
        if st.structured_output_cache_hits > 0:
            self.counter_so_hits.inc(st.structured_output_cache_hits)
        if st.structured_output_compile_failures > 0:
            self.counter_so_failures.inc(st.structured_output_compile_failures)
        self.gauge_so_entries.set(st.structured_output_cache_entries)
        self.gauge_so_capacity.set(st.structured_output_cache_capacity)

    def log(self) -> None:  # stat-logger interface; Prometheus is pull-based
        pass

    def render(self) -> bytes:
        """The metrics in Prometheus text exposition format."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


class _KVTierCollector:
    """Reads the KV connector's latest totals at scrape time (they are monotonic in the engine)."""

    _COUNTERS = (("hits", "kv_tier_hit_blocks", "KV blocks found in the tier at lookup."),
                 ("loads", "kv_tier_load_blocks", "KV blocks loaded from the tier into the KV cache."),
                 ("load_bytes", "kv_tier_load_bytes", "Bytes loaded from the tier into the KV cache."),
                 ("saves", "kv_tier_save_blocks", "KV blocks stored in the tier."),
                 ("save_bytes", "kv_tier_save_bytes", "Bytes stored in the tier."),
                 ("evictions", "kv_tier_evicted_blocks", "KV blocks evicted from the tier by its bound."),
                 ("errors", "kv_tier_errors", "Unreadable, corrupt or foreign block files and failed writes."),
                 ("dropped", "kv_tier_dropped_blocks", "KV blocks not stored (over the bound or the write queue)."))
    _GAUGES = (("blocks", "kv_tier_blocks", "KV blocks held in the tier."),
               ("bytes", "kv_tier_bytes", "Bytes held in the tier."),
               ("capacity_bytes", "kv_tier_capacity_bytes", "The tier's byte bound."))

    def __init__(self, prefix: str, model_name: str) -> None:
        self.prefix = prefix
        self.model_name = model_name
        self.stats: Optional[dict] = None

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.stats
        if not st:
            return
        p, m = self.prefix, self.model_name
        tiers = st.get("tiers", {})
        for key, name, doc in self._COUNTERS:
            c = CounterMetricFamily(p + name, doc, labels=["model_name", "tier"])
            for tier, d in tiers.items():
                c.add_metric([m, tier], d.get(key, 0))
            yield c
        for key, name, doc in self._GAUGES:
            g = GaugeMetricFamily(p + name, doc, labels=["model_name", "tier"])
            for tier, d in tiers.items():
                g.add_metric([m, tier], d.get(key, 0))
            yield g
        c = CounterMetricFamily(p + "kv_tier_hit_tokens", "Prompt tokens loaded from a KV tier instead of computed.",
                                labels=["model_name"])
        c.add_metric([m], st.get("hit_tokens", 0))
        yield c
        c = CounterMetricFamily(p + "kv_tier_load_seconds", "Seconds spent finding and reading KV blocks in the tiers.",
                                labels=["model_name"])
        c.add_metric([m], st.get("load_seconds", 0.0))
        yield c
        if "transfers" in st:  # P2pConnector: per-request KV transfers by event
            c = CounterMetricFamily(p + "kv_transfer_requests", "P2P KV transfers by event (staged, sent, released, "
                                    "expired, evicted on a producer; received, failed, release_sent on a consumer).",
                                    labels=["model_name", "event"])
            for ev, n in st["transfers"].items():
                c.add_metric([m, ev], n)
            yield c
