"""The provisioned Grafana dashboard (deploy/grafana/dashboards/) queries only what a running server's
``/metrics`` exposes: after a ``tiered`` turn and a refused request, every metric name in every panel's
query has samples there."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import WsChat, local_server, turn_until_done

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/rocketkv-mt.json"
METRIC = re.compile(r"\brkv_[a-z0-9_]+\b")


def queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return {name for expr in exprs for name in METRIC.findall(expr)}


async def test_every_metric_the_dashboard_queries_is_on_metrics(loaded, redis_url):
    queried = queried_metrics()
    assert {"rkv_tier_bytes", "rkv_turn_tokens_total", "rkv_refusals_total",
            "rkv_inter_token_latency_seconds_bucket"} <= queried  # the panels the issue asks for are there
    with local_server(loaded, redis_url=redis_url, redis_namespace="rkvtest-dash") as server:
        info = httpx.post(f"{server.url}/v1/sessions", json={"mode": "tiered", "budget": 32}).json()
        async with WsChat.open(server.ws_url) as chat:
            await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
            assert (await chat.recv())["type"] == "session"
            await turn_until_done(chat, "Name three rivers of Europe and one fact about each.", max_tokens=6)
        assert httpx.get(f"{server.url}/v1/sessions/s_missing").status_code == 404  # an error to count
        text = httpx.get(f"{server.url}/metrics").text
        httpx.delete(f"{server.url}/v1/sessions/{info['session_id']}", headers={"x-session-token": info["token"]})
    exposed = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    assert queried - exposed == set()
