"""``rocketkv-mt bench soak``: its checks on their own (the Redis one against a real Redis, keys written
by the store and the tier themselves), its report table, and a short whole run (slow)."""
from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import pytest

from bench.report import TABLES
from bench.results import kind
from bench.soak import fault_plan, parse_range
from bench.soak_checks import Acked, compare_history, host_slots, orphan_keys, session_key, session_of
from cli.main import build_parser


@pytest.fixture
def namespace(redis_url):
    import redis

    ns = f"rkv-soak-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    yield ns
    for key in client.scan_iter(match=f"{ns}:*"):
        client.delete(key)
    client.close()


def test_orphan_keys_are_the_session_keys_no_record_names(redis_url, namespace):
    import redis

    from app.session_store import SessionStore
    from tiers.redis_client import RedisClient
    from tiers.redis_tier import RedisTier

    connection = RedisClient(redis_url)
    store, tier = SessionStore(connection, namespace), RedisTier(connection, namespace)
    try:
        asyncio.run(store.save({"id": "s_live"}, {}, None))
        asyncio.run(store.save({"id": "s_gone"}, {}, None))
        asyncio.run(store.delete("s_gone"))
    finally:
        connection.close()
    client = redis.Redis.from_url(redis_url)
    assert client.exists(session_key(namespace, "s_live"))  # the bench names records as the store does
    for sid in ("s_live", "s_gone", "s_never"):
        client.set(tier.chunk_key(sid, "0"), b"x")
    client.hset(session_key(namespace, "s_half"), "summary", "{}")  # a hash that is no record
    client.set(f"{namespace}:replica:r0", b"{}")  # outside the session namespace: not looked at
    found = orphan_keys(client, namespace, count=2)  # small SCAN pages: the cursor is followed
    # A live record without KV names no page; a tombstone names itself alone.
    assert found == sorted([tier.chunk_key("s_live", "0"), tier.chunk_key("s_gone", "0"),
                            tier.chunk_key("s_never", "0"), session_key(namespace, "s_half")])
    assert {session_of(namespace, k) for k in found} == {"s_live", "s_gone", "s_never", "s_half"}
    client.close()


def test_a_record_owns_exactly_its_generation(redis_url, namespace):
    """A persisted generation: its tables, the pages they list and the manifest are owned; another
    generation's table and a page nothing lists are orphans."""
    import json

    import redis
    import torch

    from tiers.redis_client import RedisClient
    from tiers.redis_tier import RedisTier

    connection = RedisClient(redis_url)
    tier = RedisTier(connection, namespace)
    page = {"keys": torch.ones(4, 2)}
    index = {"ids0": torch.tensor([(7 << 32) | 3], dtype=torch.int64), "pos0": torch.zeros(1, 4)}
    try:
        assert tier.put_pages("s_a", {"l0-00000007-3": page, "l0-00000007-4": page, "g1.index-l0": index,
                                      "g1.primary-l0": page, "g0.index-l0": index})
    finally:
        connection.close()
    client = redis.Redis.from_url(redis_url)
    client.hset(session_key(namespace, "s_a"), mapping={
        "version": 1, "data": json.dumps({"id": "s_a", "kv": {"gen": "g1", "layers": 1}})})
    assert orphan_keys(client, namespace) == sorted([tier.chunk_key("s_a", "l0-00000007-4"),
                                                     tier.chunk_key("s_a", "g0.index-l0")])

    def nothing(redis_client, record_key, keys):  # a rule can be passed in
        return []

    assert orphan_keys(client, namespace, rule=nothing) == []
    client.close()


def _messages(turns: list[tuple[str, str]]) -> list[dict]:
    return [m for c, r in turns for m in ({"role": "user", "content": c}, {"role": "assistant", "content": r})]


def test_compare_history_tells_lost_duplicated_changed_and_unexpected_turns():
    acked = [Acked(0, "a", "A", [1, 2]), Acked(1, "b", "B", [1, 2, 3]), Acked(2, "c", "C", [1, 2, 3, 4])]
    assert compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]), [1, 2, 3, 4]).ok
    # the turn sent last and never acknowledged may be there once
    assert compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C"), ("d", "D")]), [1, 2, 3, 4, 5],
                           in_doubt="d").ok
    lost = compare_history(acked, _messages([("a", "A"), ("b", "B")]), [1, 2, 3])
    assert lost.lost == [2] and lost.tokens_rewritten and not lost.ok
    twice = compare_history(acked, _messages([("a", "A"), ("b", "B"), ("b", "B"), ("c", "C")]), [1, 2, 3, 4, 9])
    assert twice.duplicated == [1] and not twice.ok
    changed = compare_history(acked, _messages([("a", "A"), ("b", "X"), ("c", "C")]), [1, 2, 3, 4])
    assert changed.changed == [1]
    extra = compare_history(acked, _messages([("a", "A"), ("z", "Z"), ("b", "B"), ("c", "C")]), [1, 2, 3, 4])
    assert extra.unexpected == 1
    ids = compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]), [1, 2, 3, 5])
    assert ids.tokens_rewritten and not ids.lost
    assert compare_history(acked, _messages([("b", "B"), ("a", "A"), ("c", "C")]), [1, 2, 3, 4]).reordered


def test_host_slots_are_the_live_sessions_exactly():
    assert host_slots(300, {"s1": 100, "s2": 200}, deleted=set())["ok"]
    leak = host_slots(350, {"s1": 100, "s2": 200}, deleted={"s2"})
    assert leak == {"host_bytes": 350, "live_sessions_bytes": 100, "deleted_sessions_held": 1,
                    "deleted_sessions_bytes": 200, "unaccounted_bytes": 50, "ok": False}


def test_fault_plan_and_arguments():
    args = build_parser().parse_args(["bench", "soak", "--duration", "130", "--restart-every", "40",
                                      "--replicas", "2", "--redis-restart-at", "0.5"])
    assert fault_plan(args) == [(40, "replica", 0), (65.0, "redis", -1), (80, "replica", 1), (120, "replica", 0)]
    assert parse_range("3-20") == (3, 20) and parse_range("4") == (4, 4)
    with pytest.raises(ValueError):
        parse_range("5-2")


def _result(**over) -> dict:
    data = {
        "soak": {"duration_s": 10, "sessions": 2, "replicas": 2, "mode": "tiered", "budget": 32, "max_tokens": 4,
                 "host_tier_bytes": 1 << 24, "session_turns": [2, 4]},
        "wall_s": 12.0, "turns_done": 9, "turns_replayed": 1, "turns_failed": {"connection": 2, "busy": 1},
        "requests_failed": {}, "sessions_created": 3, "deletes": 1, "sessions_surviving": 2, "turns_in_doubt": 0,
        "sessions_given_up": {}, "restarts": {"replica": 1, "redis": 1, "failed": 0},
        "checks": {"history": {"sessions": 2, "turns": {"acknowledged": 9}}, "deleted": {"sessions": 1},
                   "orphan_keys": {"keys": 0}, "host_slots": {"r0": {"ok": True}, "r1": {"ok": True}}},
        "violations": {"history": 0, "lost_turns": 0, "duplicated_turns": 0, "deleted_answering": 0,
                       "orphan_keys": 0, "host_slots": 0},
        "ok": True,
    }
    data.update(over)
    return data


def test_report_renders_a_soak_result_as_counts_and_checks():
    data = _result()
    assert kind(data) == "soak"
    text = "\n".join(TABLES["soak"](data))
    assert "**No violation.**" in text
    assert "| turn attempts failed: `connection` | 2 |" in text
    assert "| deleted sessions answering on a replica | 1 sessions | 0 |" in text
    bad = "\n".join(TABLES["soak"](_result(ok=False, violations={**data["violations"], "orphan_keys": 3})))
    assert "**Violations found.**" in bad and "| Redis keys of the session namespace without a live record | every key | 3 |" in bad


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server for its private Redis")
def test_a_short_soak_runs_its_faults_and_checks(tmp_path):
    """Two clients, two replicas, a replica killed and Redis restarted: the run ends, counts what it did,
    checks every surviving session, and exits 1 exactly when it reports a violation."""
    out = tmp_path / "soak.json"
    args = build_parser().parse_args([
        "bench", "soak", "--duration", "12", "--sessions", "2", "--replicas", "2", "--restart-every", "4",
        "--replica-down-s", "0.5", "--redis-restart-at", "0.6", "--redis-down-s", "1", "--settle-s", "1",
        "--session-turns", "2-4", "--drain", "20", "--json", str(out), "--quiet",
    ])
    code = args.func(args)
    data = json.loads(out.read_text())
    assert data["turns_done"] > 0 and data["sessions_created"] >= 2
    assert data["restarts"]["replica"] >= 1 and data["restarts"]["failed"] == 0
    assert data["quiesced"]
    assert data["checks"]["history"]["sessions"] == data["sessions_surviving"]
    assert set(data["checks"]["host_slots"]) == {"r0", "r1"}
    assert code == (0 if data["ok"] else 1) and data["ok"] == (not any(data["violations"].values()))
