"""Prometheus families of a replica's health beside its load: the Redis circuit breaker and the host
tier's hard bound. Read from the same ``SessionService.stats()`` snapshot as the other service figures
(summed over replicas by the ingress: an open circuit counts the replicas whose circuit is open).
Called by ``api.metrics`` at each scrape.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


# (family, name, help, key of the stats snapshot), one value each.
FAMILIES = (
    (GaugeMetricFamily, "rkv_redis_circuit_open", "Replicas whose Redis circuit is open: Redis failed to answer "
     "and calls to it fail at once until a probe finds it back.", "redis_circuit_open"),
    (CounterMetricFamily, "rkv_redis_circuit_opens", "Times a replica's Redis circuit opened.", "redis_circuit_opens"),
    (CounterMetricFamily, "rkv_redis_calls_refused", "Redis calls failed at once while the circuit was open.",
     "redis_calls_refused"),
    (GaugeMetricFamily, "rkv_host_tier_capacity_bytes", "Hard bound of the host tier, all replicas.",
     "host_capacity_bytes"),
    (GaugeMetricFamily, "rkv_host_tier_reserved_bytes", "Host-tier bytes held for the turns in flight.",
     "host_bytes_reserved"),
    (CounterMetricFamily, "rkv_host_memory_refusals", "Turns refused with host_memory_exhausted: the host tier was "
     "full and nothing could spill to Redis.", "turns_refused_host_memory"),
)


def health_families(s: dict[str, Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    for family, name, doc, key in FAMILIES:
        metric = family(name, doc)
        metric.add_metric([], s.get(key, 0))
        yield metric
