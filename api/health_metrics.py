"""Prometheus families of a replica's health beside its load: the Redis circuit breaker and the host
tier's hard bound. Read from the same ``SessionService.stats()`` snapshot as the other service figures
(summed over replicas by the ingress: an open circuit counts the replicas whose circuit is open).
Called by ``api.metrics`` at each scrape.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def health_families(s: dict[str, Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    circuit = GaugeMetricFamily("rkv_redis_circuit_open", "Replicas whose Redis circuit is open: Redis failed "
                                "to answer and calls to it fail at once until a probe finds it back.")
    circuit.add_metric([], s.get("redis_circuit_open", 0))
    yield circuit
    opens = CounterMetricFamily("rkv_redis_circuit_opens", "Times a replica's Redis circuit opened.")
    opens.add_metric([], s.get("redis_circuit_opens", 0))
    yield opens
    refused = CounterMetricFamily("rkv_redis_calls_refused", "Redis calls failed at once while the circuit was open.")
    refused.add_metric([], s.get("redis_calls_refused", 0))
    yield refused
    capacity = GaugeMetricFamily("rkv_host_tier_capacity_bytes", "Hard bound of the host tier, all replicas.")
    capacity.add_metric([], s.get("host_capacity_bytes", 0))
    yield capacity
    reserved = GaugeMetricFamily("rkv_host_tier_reserved_bytes", "Host-tier bytes held for the turns in flight.")
    reserved.add_metric([], s.get("host_bytes_reserved", 0))
    yield reserved
    host_refusals = CounterMetricFamily("rkv_host_memory_refusals", "Turns refused with host_memory_exhausted: "
                                        "the host tier was full and nothing could spill to Redis.")
    host_refusals.add_metric([], s.get("turns_refused_host_memory", 0))
    yield host_refusals
