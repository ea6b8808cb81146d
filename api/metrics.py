"""Prometheus metrics of the HTTP layer.

Turn metrics (tokens, latency, bytes each turn moved between tiers) are counted where the turns
pass through (every ``done`` event), so one ingress sees all replicas' turns. Session and tier
figures (bytes held, entries moved, bytes each tier served and took) come from ``SessionService.stats()``,
refreshed at each scrape. Each app has its own registry (several apps can live in one process,
as in tests).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from api.health_metrics import health_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RATE_WINDOW_S = 60.0
# Bytes one turn moved between tiers (the ``memory`` of a ``done`` event, ``tiers.base.Traffic``).
TURN_TRAFFIC = {
    "cold_bytes_read": "Cold page bytes turns read back (host tier and Redis).",
    "redis_bytes_read": "Cold page bytes turns read from Redis.",
    "digest_bytes_read": "Cold page digest bytes turns scored.",
    "bytes_demoted": "Page bytes turns wrote from the device to the host tier.",
    "redis_bytes_written": "Bytes turns wrote to Redis (pages, primary sets, page tables).",
}
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _ServiceCollector(Collector):
    def __init__(self):
        self.snapshot: dict[str, Any] = {}

    def collect(self):
        s = self.snapshot
        sessions = GaugeMetricFamily("rkv_sessions", "Sessions held in replica memory.")
        sessions.add_metric([], s.get("sessions", 0))
        yield sessions
        busy = GaugeMetricFamily("rkv_sessions_generating", "Sessions generating a reply now.")
        busy.add_metric([], s.get("busy", 0))
        yield busy
        tiers = GaugeMetricFamily("rkv_tier_bytes", "KV bytes per memory tier, all sessions.", labels=["tier"])
        for tier in ("device", "host", "redis"):
            tiers.add_metric([tier], s.get(f"{tier}_bytes", 0))
        yield tiers
        for name in ("promotions", "demotions", "spills"):
            fam = CounterMetricFamily(f"rkv_tier_{name}", f"KV entries moved by tier {name}.")
            fam.add_metric([], s.get(name, 0))
            yield fam
        for name, what in (("bytes_read", "read from"), ("bytes_written", "written to")):
            fam = CounterMetricFamily(f"rkv_tier_{name}", f"Payload bytes {what} each cold tier.", labels=["tier"])
            for tier in ("host", "redis"):
                fam.add_metric([tier], s.get(f"{tier}_{name}", 0))
            yield fam
        replicas = GaugeMetricFamily("rkv_replicas", "Chat replicas reporting.")
        replicas.add_metric([], s.get("replicas", 1))
        yield replicas
        yield from health_families(s)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("rkv_turns", "Finished turns.", ["finish_reason"], registry=r)
        self.generated = Counter("rkv_generated_tokens", "Generated tokens.", registry=r)
        self.prompt = Counter("rkv_prompt_tokens", "History tokens at the start of turns.", registry=r)
        self.prefilled = Counter("rkv_prefilled_tokens", "Tokens prefilled (not served from cache).", registry=r)
        self.readmitted = Counter("rkv_readmitted_tokens", "Cold tokens promoted back to the device.", registry=r)
        self.traffic = {name: Counter(f"rkv_turn_{name}", doc, registry=r) for name, doc in TURN_TRAFFIC.items()}
        self.errors = Counter("rkv_errors", "Errors returned, by code.", ["code"], registry=r)
        self.latency = Histogram(
            "rkv_turn_latency_seconds", "Turn latency, message to done.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "rkv_time_to_first_token_seconds", "Prefill time of a turn.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens_per_s = Gauge(
            "rkv_generated_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s.",
            registry=r,
        )
        self.tokens_per_s.set_function(self._rate)
        self._recent: deque[tuple[float, int]] = deque()
        self._service = _ServiceCollector()
        r.register(self._service)

    def _rate(self) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def observe(self, event: dict[str, Any]) -> None:
        """Count one server event on its way out."""
        kind = event.get("type")
        if kind == "error":
            self.errors.labels(event.get("code", "unknown")).inc()
        elif kind == "done":
            usage = event["usage"]
            self.turns.labels(event["finish_reason"]).inc()
            self.generated.inc(usage["generated_tokens"])
            self.prompt.inc(usage["prompt_tokens"])
            self.prefilled.inc(usage["prefilled_tokens"])
            memory = event.get("memory") or {}
            self.readmitted.inc(memory.get("readmitted_tokens", 0))
            for name, counter in self.traffic.items():
                counter.inc(memory.get(name) or 0)
            self.latency.observe(event.get("latency_ms", 0.0) / 1000)
            self.ttft.observe(event.get("ttft_ms", 0.0) / 1000)
            self._recent.append((time.monotonic(), usage["generated_tokens"]))

    def render(self, snapshot: dict[str, Any]) -> bytes:
        self._service.snapshot = snapshot
        return generate_latest(self.registry)
