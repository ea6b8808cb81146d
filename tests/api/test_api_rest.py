"""Session REST API, export/import, health, metrics, and restore from Redis without Ray."""
from __future__ import annotations

import json
import uuid

from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import WsChat, local_server

from api.routes import create_app
from api.server import with_stats_route
from api.service_client import LocalTransport, ServiceClient
from app.chat_service import ChatService
from tiers.base import TierStats
from tiers.host.tier import HostTier
from tiers.store.redis.keys import session_key


@pytest.fixture(scope="module")
def server(loaded):
    with local_server(loaded) as srv:
        yield srv


def auth(info: dict) -> dict:
    return {"x-session-token": info["token"]}


async def ws_turns(server, info: dict, *messages: str) -> list[dict]:
    async with WsChat.open(server.ws_url) as chat:
        await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
        assert (await chat.recv())["type"] == "session"
        dones = []
        for text in messages:
            _, done = await chat.turn(text)
            assert done["type"] == "done", done
            dones.append(done)
        return dones


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_healthz(server):
    r = httpx.get(f"{server.url}/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "replica": "test-replica", "model": "SmolLM2-135M-Instruct",
                        "backend": "local"}
    assert r.headers["x-replica"] == "test-replica"


async def test_sessions_crud(server):
    url = f"{server.url}/v1/sessions"
    r = httpx.post(url, json={"mode": "snapkv", "budget": 64, "system": "Be brief."})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["mode"] == "snapkv" and info["budget"] == 64 and info["token"] and r.headers["x-replica"]
    sid = info["session_id"]

    assert sid in [s["session_id"] for s in httpx.get(url).json()["sessions"]]
    listed = next(s for s in httpx.get(url).json()["sessions"] if s["session_id"] == sid)
    assert "messages" not in listed and "token" not in listed

    await ws_turns(server, info, "Hello there.")
    detail = httpx.get(f"{url}/{sid}", headers=auth(info)).json()
    assert [m["role"] for m in detail["messages"]] == ["system", "user", "assistant"]
    assert detail["turns"] == 1 and detail["mode"] == "snapkv"
    assert detail["tokens"]["history"] == detail["history_tokens"] > 0
    assert 0 < detail["tokens"]["device"] <= detail["tokens"]["history"]
    assert detail["memory"]["device_bytes"] > 0
    assert {"host_bytes", "redis_bytes", "readmitted_tokens"} <= set(detail["memory"])

    for headers in ({}, {"x-session-token": "wrong"}):
        r = httpx.get(f"{url}/{sid}", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert httpx.delete(f"{url}/{sid}", headers={"x-session-token": "wrong"}).status_code == 404
    assert httpx.delete(f"{url}/{sid}", headers=auth(info)).status_code == 204
    assert httpx.get(f"{url}/{sid}", headers=auth(info)).status_code == 404
    assert sid not in [s["session_id"] for s in httpx.get(url).json()["sessions"]]


def test_bad_requests(server):
    url = f"{server.url}/v1/sessions"
    r = httpx.post(url, json={"mode": "warp"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_mode"
    r = httpx.post(url, json={"budget": "lots"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(f"{url}/import", json={"messages": [{"role": "user", "content": "x"}], "token_ids": [-1]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(f"{url}/import", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400


async def test_export_import_round_trip(server):
    url = f"{server.url}/v1/sessions"
    info = httpx.post(url, json={"mode": "rocketkv", "budget": 64}).json()
    await ws_turns(server, info, "My dog is called Rex.", "What animal do I have?")
    exported = httpx.get(f"{url}/{info['session_id']}/export", headers=auth(info)).json()
    assert exported["format"] == "rocketkv-mt.session/1"
    assert exported["mode"] == "rocketkv" and exported["budget"] == 64
    assert len(exported["messages"]) == 4 and len(exported["token_ids"]) > 30

    r = httpx.post(f"{url}/import", content=json.dumps(exported), headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text
    copy = r.json()
    assert copy["session_id"] != info["session_id"] and copy["token"] != info["token"]
    detail = httpx.get(f"{url}/{copy['session_id']}", headers=auth(copy)).json()
    assert detail["messages"] == exported["messages"] and detail["mode"] == "rocketkv" and detail["budget"] == 64
    assert detail["tokens"] == {"history": len(exported["token_ids"]), "cached": 0, "device": 0}

    (orig,) = await ws_turns(server, info, "And its name?")
    (imported,) = await ws_turns(server, copy, "And its name?")
    # Same conversation, same prompt; the import rebuilt its cache by prefilling everything once.
    assert imported["usage"]["prompt_tokens"] == orig["usage"]["prompt_tokens"]
    assert imported["usage"]["prefilled_tokens"] == imported["usage"]["prompt_tokens"]
    assert orig["usage"]["prefilled_tokens"] < orig["usage"]["prompt_tokens"] // 2
    (again,) = await ws_turns(server, copy, "Thanks.")
    assert again["usage"]["prefilled_tokens"] < again["usage"]["prompt_tokens"] // 2


async def test_metrics_move_after_a_turn(server):
    before = metric_values(httpx.get(f"{server.url}/metrics").text)
    info = httpx.post(f"{server.url}/v1/sessions", json={}).json()
    (done,) = await ws_turns(server, info, "Count to three.")
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = metric_values(r.text)

    generated = ("rkv_generated_tokens_total", ())
    assert after[generated] - before.get(generated, 0) == done["usage"]["generated_tokens"]
    assert after[("rkv_prefilled_tokens_total", ())] > before.get(("rkv_prefilled_tokens_total", ()), 0)
    count = ("rkv_turn_latency_seconds_count", ())
    assert after[count] == before.get(count, 0) + 1
    assert after[("rkv_turns_total", (("finish_reason", done["finish_reason"]),))] >= 1
    assert after[("rkv_generated_tokens_per_second", ())] > 0
    assert after[("rkv_sessions", ())] >= 1
    assert after[("rkv_tier_bytes", (("tier", "device"),))] > 0
    for tier in ("host", "redis"):
        assert ("rkv_tier_bytes", (("tier", tier),)) in after
    for move in ("promotion", "demotion", "spill"):
        assert after[("rkv_tier_page_moves_total", (("move", move),))] >= 0
    # Bytes moved: per turn from the done event, per tier from the tiers' own counters (= /v1/stats).
    memory = done["memory"]
    moved = {"host_to_device": memory["cold_bytes_read"] - memory["redis_bytes_read"],
             "redis_to_device": memory["redis_bytes_read"], "device_to_host": memory["bytes_demoted"],
             "to_redis": memory["redis_bytes_written"]}
    for direction, nbytes in moved.items():
        name = ("rkv_turn_moved_bytes_total", (("direction", direction),))
        assert after[name] - before.get(name, 0) == nbytes, direction
    digest = ("rkv_turn_digest_read_bytes_total", ())
    assert after[digest] - before.get(digest, 0) == memory["digest_bytes_read"]
    # Where the history was at the turn's end, per layer and KV head: the done event's map summary.
    summary = done["memory_map"]
    slots = summary["layers"] * summary["kv_heads"]
    for tier in ("device", "host", "redis"):
        name = ("rkv_turn_tokens_total", (("tier", tier),))
        assert after[name] - before.get(name, 0) == pytest.approx(summary[tier] / slots), tier
    assert after[("rkv_turn_tokens_total", (("tier", "device"),))] > 0
    gaps = ("rkv_inter_token_latency_seconds_count", ())
    assert after[gaps] - before.get(gaps, 0) == max(0, done["usage"]["generated_tokens"] - 1)
    stats = httpx.get(f"{server.url}/v1/stats").json()
    for tier in ("host", "redis"):
        for field in ("read", "written"):
            assert after[(f"rkv_tier_{field}_bytes_total", (("tier", tier),))] == stats[f"{tier}_bytes_{field}"] >= 0
    assert after[("rkv_tier_page_moves_total", (("move", "spill"),))] == stats["spills"]


class TrafficEngine:
    """Just what ``ChatService.stats`` reads of an engine: no sessions, a real host tier, a Redis stand-in."""

    def __init__(self, host: HostTier, redis_stats: TierStats):
        self.sessions: dict = {}
        self.host_tier = host
        self.redis = SimpleNamespace(stats=redis_stats)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_tier_and_turn_traffic_in_stats_and_metrics():
    """No model: a service over a stand-in engine, and done events counted by the metrics."""
    host = HostTier(1 << 20, pin=False)
    page = {"keys": torch.ones(3, 4, 8), "values": torch.zeros(3, 4, 8)}  # 3 pages of 256 bytes
    host.put_many("s", ["a", "b", "c"], page)
    host.read_many("s", ["a", "c"])
    host.stats.spills = 2
    redis_stats = TierStats(bytes_read=700, bytes_written=900, promotions=1, demotions=4)
    service = ChatService(TrafficEngine(host, redis_stats), "fake")
    app = with_stats_route(create_app(ServiceClient(LocalTransport(service), "none", service.replica)))
    memory = {"cold_bytes_read": 512, "redis_bytes_read": 256, "digest_bytes_read": 64, "bytes_demoted": 1024,
              "redis_bytes_written": 2048, "readmitted_tokens": 3}
    done = {"type": "done", "finish_reason": "stop", "memory": memory,
            "usage": {"generated_tokens": 2, "prompt_tokens": 10, "prefilled_tokens": 10}}
    with TestClient(app) as client:
        stats = client.get("/v1/stats").json()
        assert stats["host_bytes_written"] == 3 * 256 and stats["host_bytes_read"] == 2 * 256
        assert stats["redis_bytes_read"] == 700 and stats["redis_bytes_written"] == 900
        assert stats["spills"] == 2 and stats["promotions"] == 1 and stats["demotions"] == 3 + 4
        app.state.metrics.observe(done)
        app.state.metrics.observe({**done, "memory": {**memory, "bytes_demoted": 1}})
        values = metric_values(client.get("/metrics").text)
    for tier in ("host", "redis"):
        for field in ("read", "written"):
            assert values[(f"rkv_tier_{field}_bytes_total", (("tier", tier),))] == stats[f"{tier}_bytes_{field}"]
    assert values[("rkv_tier_page_moves_total", (("move", "spill"),))] == 2
    assert values[("rkv_tier_page_moves_total", (("move", "promotion"),))] == 1
    assert values[("rkv_tier_page_moves_total", (("move", "demotion"),))] == 3 + 4
    moved = {"host_to_device": 2 * (512 - 256), "redis_to_device": 2 * 256, "device_to_host": 1024 + 1,
             "to_redis": 2 * 2048}
    for direction, nbytes in moved.items():
        assert values[("rkv_turn_moved_bytes_total", (("direction", direction),))] == nbytes, direction
    assert values[("rkv_turn_digest_read_bytes_total", ())] == 2 * 64
    assert values[("rkv_readmitted_tokens_total", ())] == 6


def test_refusals_are_counted_by_cause_and_every_error_by_code():
    app = create_app(ServiceClient(LocalTransport(ChatService(TrafficEngine(HostTier(1 << 20, pin=False),
                                                                              TierStats()), "fake")), "none", "fake"))
    metrics = app.state.metrics
    for code in ("device_memory_exhausted", "device_memory_exhausted", "rate_limited", "session_not_found"):
        metrics.observe({"type": "error", "code": code, "message": "x"})
    with TestClient(app) as client:
        values = metric_values(client.get("/metrics").text)
    assert values[("rkv_refusals_total", (("cause", "device_memory_exhausted"),))] == 2
    assert values[("rkv_refusals_total", (("cause", "rate_limited"),))] == 1
    assert ("rkv_refusals_total", (("cause", "session_not_found"),)) not in values  # not a refusal: an error
    assert values[("rkv_errors_total", (("code", "session_not_found"),))] == 1


async def test_another_process_restores_a_session_from_redis(loaded, redis_url):
    """Two in-process servers share Redis: B continues A's session, then A notices its copy is stale."""
    import redis

    prefix = f"rkv-test-{uuid.uuid4().hex[:8]}"
    settings = {"redis_url": redis_url, "redis_namespace": prefix}
    with local_server(loaded, replica_id="a", **settings) as a, local_server(loaded, replica_id="b", **settings) as b:
        info = httpx.post(f"{a.url}/v1/sessions", json={"system": "Be brief.", "mode": "full"}).json()
        first, second = await ws_turns(a, info, "My name is Kim.", "Nice to meet you.")
        stored = redis.Redis.from_url(redis_url).hgetall(session_key(prefix, info["session_id"]))
        data = json.loads(stored[b"data"])  # plain JSON, no pickle
        assert data["messages"][-1]["role"] == "assistant" and len(data["messages"]) == 5
        # Fenced by the tag its last save drew, after those of the saves before: created, then two turns.
        lineage = stored[b"lineage"].split()
        assert len(lineage) == 3 == len(set(lineage)) and lineage[-1] == stored[b"tag"] and b"version" not in stored

        (on_b,) = await ws_turns(b, info, "What is my name?")
        assert on_b["replica"] == "b"
        history = second["usage"]["prompt_tokens"] + second["usage"]["generated_tokens"]
        assert on_b["usage"]["prompt_tokens"] > history  # the earlier turns came along
        assert on_b["usage"]["prefilled_tokens"] == on_b["usage"]["prompt_tokens"]  # cache rebuilt on b

        (back_on_a,) = await ws_turns(a, info, "Bye.")
        assert back_on_a["usage"]["prompt_tokens"] > on_b["usage"]["prompt_tokens"]  # a restored b's turn
        detail = httpx.get(f"{a.url}/v1/sessions/{info['session_id']}", headers=auth(info)).json()
        assert len(detail["messages"]) == 9

        listed = httpx.get(f"{b.url}/v1/sessions").json()["sessions"]
        assert info["session_id"] in [s["session_id"] for s in listed]
        live = redis.Redis.from_url(redis_url).hgetall(session_key(prefix, info["session_id"]))
        lineage = live[b"lineage"].split()
        assert len(lineage) == 5 and lineage[:3] == stored[b"lineage"].split()  # 5 saves, one history
        assert httpx.delete(f"{a.url}/v1/sessions/{info['session_id']}", headers=auth(info)).status_code == 204
        # A tombstone stays for one TTL (no save in flight can bring the session back, its tag being none a
        # copy holds); its data is gone.
        tomb = redis.Redis.from_url(redis_url).hgetall(session_key(prefix, info["session_id"]))
        assert tomb[b"deleted"] == b"1" and b"data" not in tomb and b"lineage" not in tomb
        assert tomb[b"tag"] not in lineage


async def test_a_restored_tiered_session_keeps_its_kv(loaded, redis_url):
    """Where the engine stored the KV itself (tiered mode), the restore reuses it instead of re-prefilling."""
    import redis

    namespace = f"rkv-test-{uuid.uuid4().hex[:8]}"
    settings = {"redis_url": redis_url, "redis_namespace": namespace}
    with local_server(loaded, replica_id="a", **settings) as a, local_server(loaded, replica_id="b", **settings) as b:
        info = httpx.post(f"{a.url}/v1/sessions", json={"mode": "tiered", "budget": 32}).json()
        await ws_turns(a, info, "Tell me three facts about whales, please, with some detail.")
        (on_b,) = await ws_turns(b, info, "And about sharks?")
        assert on_b["replica"] == "b"
        assert on_b["usage"]["prefilled_tokens"] < on_b["usage"]["prompt_tokens"] // 2
        assert httpx.delete(f"{b.url}/v1/sessions/{info['session_id']}", headers=auth(info)).status_code == 204
    left = [k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(match=f"{namespace}:session*")]
    assert left == [session_key(namespace, info["session_id"])]  # its tombstone alone: no KV key
