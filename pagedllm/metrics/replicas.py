"""Prometheus metrics of several data-parallel replicas in one exposition, labelled
``engine="<index>"`` (vLLM's label for the engine index), beside ``model_name``.

Each replica records into its own ``PrometheusStatLogger`` (own registry); ``render`` merges
the families sample by sample with the replica's ``engine`` label added, so every metric name
appears once with one series per replica.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from pagedllm.metrics.prometheus import PrometheusStatLogger, record_scheduler_snapshot


class _NoGauge:
    """Stands in for the single-engine gauges the server refreshes before rendering (the
    replicas' own gauges are refreshed in ``render``)."""

    def set(self, value: float) -> None:
        pass


class _MergedCollector:
    def __init__(self, loggers: Sequence[PrometheusStatLogger]) -> None:
        self.loggers = loggers

    def collect(self):
        merged: dict[str, Metric] = {}
        for i, lg in enumerate(self.loggers):
            for fam in lg.registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.samples.append(s._replace(labels={**s.labels, "engine": str(i)}))
        return list(merged.values())


class ReplicaPrometheusLogger:
    """The server's stat logger for ``num_replicas`` replicas.

    Args:
        model_name, max_model_len: as for ``PrometheusStatLogger``.
        num_replicas: replicas; replicas: objects with ``get_scheduler_stats()`` (refreshed
            into the gauges at each render), or None.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, max_model_len: int, num_replicas: int,
                 replicas: Optional[Sequence[Any]] = None, prefix: str = "pagedllm") -> None:
        self.children = [PrometheusStatLogger(model_name, max_model_len, prefix=prefix)
                         for _ in range(num_replicas)]
        self.replicas = replicas
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MergedCollector(self.children))
        self.gauge_running = self.gauge_waiting = self.gauge_kv_usage = self.gauge_so_entries = _NoGauge()

    def set_scheduler_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        pass  # the totals of all replicas: each replica's own gauges are refreshed in ``render``

    def record_memory(self, stats: dict) -> None:
        """The front-end process's memory (the replicas share it) on every replica's series."""
        for child in self.children:
            child.record_memory(stats)

    def record_lora(self, stats: dict) -> None:
        pass  # the replicas' adapters: each replica's own gauges are refreshed in ``render``

    def record_replica(self, index: int, scheduler_stats: Any, iteration_stats: Any) -> None:
        self.children[index].record(scheduler_stats, iteration_stats)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:  # not per replica: ignored
        pass

    def log(self) -> None:
        pass

    def render(self) -> bytes:
        if self.replicas is not None:
            for child, r in zip(self.children, self.replicas):
                record_scheduler_snapshot(child, r.get_scheduler_stats())
        return generate_latest(self.registry)
