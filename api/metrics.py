"""Prometheus metrics of the HTTP layer, named as Prometheus and its exporters name theirs: counters end
in ``_total``, sizes in ``_bytes``, times in ``_seconds``, and what differs only by tier, direction or
cause is one metric with a label (docs/observability.md lists them all).

Turn metrics (tokens, latency, where the history is, bytes each turn moved between tiers) are counted
where the turns pass through (every ``done`` event), so one ingress sees all replicas' turns. Session
and tier figures (bytes held, pages moved, bytes each tier served and took) come from
``SessionService.stats()``, refreshed at each scrape. Each app has its own registry (several apps can
live in one process, as in tests).
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
TIERS = ("device", "host", "redis")
COLD_TIERS = ("host", "redis")
# The ``direction`` of ``rkv_turn_moved_bytes_total``, from one turn's traffic (the ``memory`` of a
# ``done`` event, ``tiers.base.Traffic``): the bytes it moved that way.
DIRECTIONS = {
    "host_to_device": lambda m: (m.get("cold_bytes_read") or 0) - (m.get("redis_bytes_read") or 0),
    "redis_to_device": lambda m: m.get("redis_bytes_read") or 0,
    "device_to_host": lambda m: m.get("bytes_demoted") or 0,
    "to_redis": lambda m: m.get("redis_bytes_written") or 0,
}
# Error codes that refuse work the request was entitled to ask for (a limit or a lack of room), by cause.
REFUSALS = ("device_memory_exhausted", "host_memory_exhausted", "too_many_sessions", "rate_limited", "session_busy",
            "context_length_exceeded", "message_too_large", "max_tokens_too_large", "request_too_large",
            "replica_unavailable", "quota_exceeded")
DURABILITY = ("none", "memory", "fsync", "replicated")
# Page moves of the tiers (``tiers.base.TierStats``), by kind.
PAGE_MOVES = ("promotions", "demotions", "spills")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)


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
        tiers = GaugeMetricFamily("rkv_tier_bytes", "KV bytes held per memory tier, all sessions.", labels=["tier"])
        for tier in TIERS:
            tiers.add_metric([tier], s.get(f"{tier}_bytes", 0))
        yield tiers
        budget = GaugeMetricFamily("rkv_device_budget_bytes", "Device memory the replicas' KV caches may hold (0: no bound).")
        budget.add_metric([], s.get("device_budget_bytes", 0))
        yield budget
        moves = CounterMetricFamily("rkv_tier_page_moves", "Cold pages moved: promotions (Redis back to the host "
                                    "tier), demotions (device to host tier), spills (host tier to Redis).",
                                    labels=["move"])
        for name in PAGE_MOVES:
            moves.add_metric([name.removesuffix("s")], s.get(name, 0))
        yield moves
        for name, what in (("read", "read from"), ("written", "written to")):
            fam = CounterMetricFamily(f"rkv_tier_{name}_bytes", f"Payload bytes {what} each cold tier.", labels=["tier"])
            for tier in COLD_TIERS:
                fam.add_metric([tier], s.get(f"{tier}_bytes_{name}", 0))
            yield fam
        parked = CounterMetricFamily("rkv_sessions_parked", "Idle sessions whose cache left the device to make room.")
        parked.add_metric([], s.get("sessions_parked_total", 0))
        yield parked
        losses = CounterMetricFamily("rkv_store_losses", "Saves Redis was found to have lost: saved back from a "
                                     "replica's copy (`behind`), or reported to the session's caller because another "
                                     "replica went on from the older state (`diverged`).", labels=["kind"])
        losses.add_metric(["behind"], s.get("store_losses", 0))
        losses.add_metric(["diverged"], s.get("divergences", 0))
        yield losses
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
        self.readmitted = Counter("rkv_readmitted_tokens", "Cold tokens turns promoted back to the device "
                                  "(per layer and KV head).", registry=r)
        self.held = Counter("rkv_turn_tokens", "History tokens each tier held at the end of each turn, where the "
                            "turn's next step reads them (per layer and KV head).", ["tier"], registry=r)
        self.moved = Counter("rkv_turn_moved_bytes", "Bytes turns moved between tiers, by direction.", ["direction"],
                             registry=r)
        self.digests = Counter("rkv_turn_digest_read_bytes", "Cold page digest and sketch bytes turns scored.",
                               registry=r)
        self.saves = Counter("rkv_turn_saves", "Finished turns by what their save gave: none (kept in memory), "
                             "memory, fsync or replicated (README: What a client can rely on).", ["durability"],
                             registry=r)
        self.errors = Counter("rkv_errors", "Errors returned, by code.", ["code"], registry=r)
        self.refusals = Counter("rkv_refusals", "Requests refused for a limit or a lack of room, by cause "
                                "(their error code).", ["cause"], registry=r)
        self.latency = Histogram(
            "rkv_turn_latency_seconds", "Turn latency, message to done.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "rkv_time_to_first_token_seconds", "Time from a message to its first token (the turn's prefill).",
            buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "rkv_inter_token_latency_seconds", "Time between two generated tokens of a turn (its decode time over "
            "its tokens after the first, once per token).", buckets=TOKEN_BUCKETS, registry=r
        )
        self.tokens_per_s = Gauge(
            "rkv_generated_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s.",
            registry=r,
        )
        self.tokens_per_s.set_function(self._rate)
        # Every fixed label value from the start: a series that appears only once it moves hides from
        # rate() and from a dashboard until then.
        for tier in TIERS:
            self.held.labels(tier)
        for direction in DIRECTIONS:
            self.moved.labels(direction)
        for cause in REFUSALS:
            self.refusals.labels(cause)
        for durability in DURABILITY:
            self.saves.labels(durability)
        self._recent: deque[tuple[float, int]] = deque()
        self._service = _ServiceCollector()
        r.register(self._service)

    def _rate(self) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def error(self, code: str) -> None:
        """Count one error answered with ``code`` (and a refusal, when it is one)."""
        self.errors.labels(code).inc()
        if code in REFUSALS:
            self.refusals.labels(code).inc()

    def observe(self, event: dict[str, Any]) -> None:
        """Count one server event on its way out."""
        kind = event.get("type")
        if kind == "error":
            self.error(event.get("code", "unknown"))
        elif kind == "done":
            usage = event["usage"]
            self.turns.labels(event["finish_reason"]).inc()
            self.generated.inc(usage["generated_tokens"])
            self.prompt.inc(usage["prompt_tokens"])
            self.prefilled.inc(usage["prefilled_tokens"])
            memory = event.get("memory") or {}
            self.readmitted.inc(memory.get("readmitted_tokens", 0))
            for direction, of in DIRECTIONS.items():
                self.moved.labels(direction).inc(max(0, of(memory)))
            self.digests.inc(memory.get("digest_bytes_read") or 0)
            if event.get("storage"):
                self.saves.labels(event["storage"]["durability"]).inc()
            self._held(event.get("memory_map"))
            latency, ttft = event.get("latency_ms", 0.0) / 1000, event.get("ttft_ms", 0.0) / 1000
            self.latency.observe(latency)
            self.ttft.observe(ttft)
            gaps = usage["generated_tokens"] - 1
            for _ in range(max(0, gaps)):
                self.inter_token.observe(max(0.0, latency - ttft) / gaps)
            self._recent.append((time.monotonic(), usage["generated_tokens"]))

    def _held(self, summary: dict[str, Any] | None) -> None:
        """Add a turn's map summary to ``rkv_turn_tokens_total``: token slots over layers and KV heads."""
        if not summary or not summary.get("layers") or not summary.get("kv_heads"):
            return
        slots = summary["layers"] * summary["kv_heads"]
        for tier in TIERS:
            self.held.labels(tier).inc(summary.get(tier, 0) / slots)

    def render(self, snapshot: dict[str, Any]) -> bytes:
        self._service.snapshot = snapshot
        return generate_latest(self.registry)
