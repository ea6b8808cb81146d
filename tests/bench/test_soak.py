"""``rocketkv-mt bench soak``: its checks on their own (the Redis ones against a real Redis, keys written
by the session store and the page store themselves), how a client goes on after Redis lost writes, the
reference comparison, the fault plan, its report table, and a short whole run (slow); the client against
a fake replica is ``test_soak_client``."""
from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid

import pytest
import torch

from bench.report import TABLES
from bench.results import kind
from bench.soak import min_replicas, parse_range, replica_env
from bench.soak_checks import (Acked, compare_history, host_slots, keys_per_session, missing_groups, orphan_keys,
                               reconcile, session_key, session_of, unfinished)
from bench.soak_faults import KINDS, applicable, fault_plan, parse_kinds
from bench.soak_fleet import LogClock
from bench.soak_reference import comparable, compare_replies
from cli.main import build_parser
from tiers.store.redis.keys import kv_key


@pytest.fixture
def namespace(redis_url):
    import redis

    ns = f"rkv-soak-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    yield ns
    for key in client.scan_iter(match=f"{ns}:*"):
        client.delete(key)
    client.close()


def _stores(redis_url, namespace):
    from app.session_store import SessionStore
    from tiers.store.redis.client import RedisClient
    from tiers.store.redis.pages import RedisPageStore

    connection = RedisClient(redis_url)
    return connection, SessionStore(connection, namespace), RedisPageStore(connection, namespace)


def _save(store, sid: str, groups: dict[str, int] | None = None):
    return asyncio.run(store.save({"id": sid}, {}, None, f"t-{sid}", [f"t-{sid}"], groups))


def test_orphan_keys_are_the_session_keys_no_record_names(redis_url, namespace):
    import redis

    connection, store, pages = _stores(redis_url, namespace)
    try:
        _save(store, "s_live")
        _save(store, "s_gone")
        asyncio.run(store.delete("s_gone", None))
        for sid in ("s_live", "s_gone", "s_never"):
            assert pages.put(sid, {"g0/item": {"t": torch.ones(2)}})
    finally:
        connection.close()
    client = redis.Redis.from_url(redis_url)
    assert client.exists(session_key(namespace, "s_live"))  # the bench names records as the store does
    client.hset(session_key(namespace, "s_half"), "summary", "{}")  # a hash that is no record
    client.set(f"{namespace}:replica:r0", b"{}")  # outside the session namespace: not looked at
    found = orphan_keys(client, namespace, count=2)  # small SCAN pages: the cursor is followed
    # A live record without KV names no group; a tombstone names itself alone.
    assert found == sorted([kv_key(namespace, "s_live", "g0"), kv_key(namespace, "s_gone", "g0"),
                            kv_key(namespace, "s_never", "g0"), session_key(namespace, "s_half")])
    assert {session_of(namespace, k) for k in found} == {"s_live", "s_gone", "s_never", "s_half"}
    assert keys_per_session(client, namespace) == {"s_live": 2}  # the record and its stray group
    client.close()


def test_a_record_owns_exactly_the_groups_it_names(redis_url, namespace):
    """A record naming groups (its ``groups`` field, written by the commit): those are owned; another
    group of the session is an orphan, and a group the record counts more items of than it holds is
    missing (its restore would rebuild the KV)."""
    import redis

    connection, store, pages = _stores(redis_url, namespace)
    try:
        assert pages.put("s_a", {"g1/a": {"t": torch.ones(2)}, "g1/b": {"t": torch.ones(2)},
                                 "g2/a": {"t": torch.ones(2)}, "g0/a": {"t": torch.ones(2)}})
        assert _save(store, "s_a", {"g1": 2, "g2": 1}).outcome == "saved"
    finally:
        connection.close()
    client = redis.Redis.from_url(redis_url)
    key = session_key(namespace, "s_a")
    assert orphan_keys(client, namespace) == [kv_key(namespace, "s_a", "g0")]
    assert keys_per_session(client, namespace) == {"s_a": 4}
    assert missing_groups(client, namespace) == []
    data = json.loads(client.hget(key, "data"))  # the record's own count of its groups' items
    client.hset(key, "data", json.dumps({**data, "kv": {"groups": {"g1": 3, "g2": 1}}}))
    client.delete(kv_key(namespace, "s_a", "g2"))
    assert missing_groups(client, namespace) == [kv_key(namespace, "s_a", "g1"), kv_key(namespace, "s_a", "g2")]

    def nothing(redis_client, record_key, keys):  # a rule can be passed in
        return []

    assert orphan_keys(client, namespace, rule=nothing) == []
    client.close()


def _messages(turns: list[tuple[str, str]]) -> list[dict]:
    return [m for c, r in turns for m in ({"role": "user", "content": c}, {"role": "assistant", "content": r})]


def _acked(*turns, durable=True) -> list[Acked]:
    return [Acked(i, c, c.upper(), ids, durability="replicated" if durable else "memory", durable=durable)
            for i, (c, ids) in enumerate(turns)]


def test_compare_history_tells_lost_duplicated_changed_and_unexpected_turns():
    acked = _acked(("a", [1, 2]), ("b", [1, 2, 3]), ("c", [1, 2, 3, 4]))
    assert compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]), [1, 2, 3, 4]).ok
    # the turn sent last and never acknowledged may be there once
    assert compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C"), ("d", "D")]), [1, 2, 3, 4, 5],
                           in_doubt="d").ok
    lost = compare_history(acked, _messages([("a", "A"), ("b", "B")]), [1, 2, 3])
    assert lost.lost == [2] and not lost.tokens_rewritten and not lost.ok  # ids after a lost turn say nothing
    twice = compare_history(acked, _messages([("a", "A"), ("b", "B"), ("b", "B"), ("c", "C")]), [1, 2, 3, 4, 9])
    assert twice.duplicated == [1] and not twice.ok
    changed = compare_history(acked, _messages([("a", "A"), ("b", "X"), ("c", "C")]), [1, 2, 3, 4])
    assert changed.changed == [1]
    extra = compare_history(acked, _messages([("a", "A"), ("z", "Z"), ("b", "B"), ("c", "C")]), [1, 2, 3, 4])
    assert extra.unexpected == 1
    ids = compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]), [1, 2, 3, 5])
    assert ids.tokens_rewritten and not ids.lost
    assert compare_history(acked, _messages([("b", "B"), ("a", "A"), ("c", "C")]), [1, 2, 3, 4]).reordered


def test_turns_acknowledged_not_durable_may_be_lost_from_the_end_only():
    acked = _acked(("a", [1]), ("b", [1, 2])) + _acked(("c", [1, 2, 3]), ("d", [1, 2, 3, 4]), durable=False)
    for turn, index in zip(acked[2:], (2, 3)):
        turn.index = index
    tail = compare_history(acked, _messages([("a", "A"), ("b", "B")]), [1, 2])
    assert tail.ok and tail.lost_not_durable == [2, 3] and not tail.lost
    # a durable turn there after a missing one: the history is not one the client was ever acknowledged
    acked[2].durable, acked[3].durable = False, True
    gap = compare_history(acked, _messages([("a", "A"), ("b", "B"), ("d", "D")]), [1, 2, 3, 4])
    assert gap.gaps == [3] and not gap.ok
    assert compare_history(acked, _messages([("a", "A")]), [1]).lost == [1, 3]


def test_reconcile_keeps_the_common_start_and_adopts_the_turn_in_doubt():
    acked = _acked(("a", None), ("b", None)) + _acked(("c", None), durable=False)
    acked[2].index = 2
    same = reconcile(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]))
    assert same.turns == acked and not same.lost and same.adopted is None
    # Redis lost turn c (not durable); the turn in doubt, d (sent as turn 3), ran on the older state
    found = reconcile(acked, _messages([("a", "A"), ("b", "B"), ("d", "D")]), in_doubt="d", doubt_index=3)
    assert [t.index for t in found.lost] == [2] and not found.lost_durable
    assert [(t.content, t.reply) for t in found.turns] == [("a", "A"), ("b", "B"), ("d", "D")]
    assert found.adopted.index == 3 and found.adopted.durability == "unknown" and not found.foreign
    assert not found.adopted.unfinished
    # the turn in doubt failed half-way: kept in the history with what it had generated, flagged
    half = _messages([("a", "A"), ("b", "B"), ("c", "C"), ("d", "D")])
    half[-1]["error"] = True
    assert reconcile(acked, half, in_doubt="d", doubt_index=3).adopted.unfinished
    # a durable turn gone, and one the client never sent
    worse = reconcile(acked, _messages([("a", "A"), ("z", "Z")]), in_doubt="d")
    assert [t.content for t in worse.lost_durable] == ["b"] and worse.adopted is None
    assert [(t.content, t.reply) for t in worse.foreign] == [("z", "Z")]
    assert [t.content for t in worse.turns] == ["a", "z"]  # the client goes on from the history as it stands
    # another reply to the same message is no match: lost from there on
    assert [t.content for t in reconcile(acked, _messages([("a", "A"), ("b", "X")])).lost] == ["b", "c"]


def test_compare_history_allows_turns_the_client_let_go_of_saved_back_with_their_reply():
    acked = [Acked(0, "a", "A")]
    sent = {"a": "A", "b": "B", "c": None}  # b acknowledged as not saved then found gone; c in doubt, dropped
    back = compare_history(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]), [1, 2, 3], sent=sent)
    assert back.ok and back.returned == 2 and not back.unexpected
    other = compare_history(acked, _messages([("a", "A"), ("b", "X"), ("z", "Z")]), [1, 2, 3], sent=sent)
    assert not other.ok and other.unexpected == 2 and not other.returned


def test_reconcile_takes_back_turns_the_client_let_go_of_and_only_those():
    """Turns the client sent and let go of (not saved, or in doubt), saved back later by the replica that
    held them, are its own; a message it never sent, or another reply than it was acknowledged, is not."""
    acked = [Acked(0, "a", "A")]
    sent = {"a": "A", "b": "B", "c": None, "d": None}
    found = reconcile(acked, _messages([("a", "A"), ("b", "B"), ("c", "C")]), in_doubt="d", doubt_index=3,
                      sent=sent)
    assert [t.content for t in found.returned] == ["b", "c"] and not found.foreign and found.adopted is None
    assert [t.content for t in found.turns] == ["a", "b", "c"]
    changed = reconcile(acked, _messages([("a", "A"), ("b", "X"), ("z", "Z")]), sent=sent)
    assert [t.content for t in changed.foreign] == ["b", "z"] and not changed.returned
    last = reconcile(acked, _messages([("a", "A"), ("c", "C"), ("d", "D")]), in_doubt="d", doubt_index=3,
                     sent=sent)
    assert [t.content for t in last.returned] == ["c"] and last.adopted.content == "d"


def test_compare_replies_reports_the_first_differing_turn_of_each_session():
    finals = {"s1": _messages([("a", "A"), ("b", "B"), ("c", "C")]), "s2": _messages([("x", "X")]),
              "s3": _messages([("y", "Y"), ("z", "Z")])}
    found = compare_replies(finals, {"s1": ["A", "b?", "C"], "s2": ["X"], "s3": ["Y"]})
    assert found["differ"] == 1 and found["incomplete"] == 1 and found["sessions"] == 3
    assert found["examples"] == [{"session": "s1", "turn": 1, "soak": "B", "reference": "b?"}]
    assert found["incomplete_examples"] == ["s3"] and found["turns"] == 4 and found["cut_short"] == 0
    assert compare_replies(finals, {k: [m["content"] for m in v[1::2]] for k, v in finals.items()})["differ"] == 0
    # A turn that failed half-way keeps its partial reply, flagged: the comparison stops before it.
    failed = _messages([("a", "A"), ("b", "B"), ("c", "C")])
    failed[3]["error"] = True
    assert unfinished(failed) == [1] and comparable(failed) == [("a", "A")]
    cut = compare_replies({"s1": failed}, {"s1": ["A"]})
    assert (cut["differ"], cut["incomplete"], cut["cut_short"], cut["turns"]) == (0, 0, 1, 1)


def test_log_clock_stamps_each_line_as_it_comes(tmp_path):
    log = tmp_path / "r0.log"
    clock = LogClock([log], every_s=0.01)
    clock.start()
    log.write_text("first\nsecond, half")
    time.sleep(0.1)
    with open(log, "a") as f:
        f.write(" written\n")
    clock.close()
    lines = (tmp_path / "r0.log.timed").read_text().splitlines()
    assert [line.split(None, 1)[1] for line in lines] == ["first", "second, half written"]
    assert all(float(line.split()[0]) >= 0 for line in lines)


def test_host_slots_are_the_live_sessions_exactly():
    assert host_slots(300, {"s1": 100, "s2": 200}, deleted=set())["ok"]
    leak = host_slots(350, {"s1": 100, "s2": 200}, deleted={"s2"})
    assert leak == {"host_bytes": 350, "live_sessions_bytes": 100, "deleted_sessions_held": 1,
                    "deleted_sessions_bytes": 200, "deleted_examples": ["s2"], "unaccounted_bytes": 50, "ok": False}


def test_fault_plan_takes_the_kinds_and_the_replicas_in_turn():
    plan = fault_plan(["kill", "crash", "cut", "slow"], every=10, duration=95, replicas=2)
    assert [(f.at, f.kind, f.replica) for f in plan] == [
        (10, "kill", 0), (20, "crash", -1), (30, "cut", 0), (40, "slow", 1),
        (50, "kill", 1), (60, "crash", -1), (70, "cut", 1), (80, "slow", 0), (90, "kill", 0)]
    assert fault_plan([], 10, 100, 2) == [] and fault_plan(["kill"], 0, 100, 2) == []


def test_which_faults_apply():
    assert applicable(None, "sentinel", netns=True) == (list(KINDS), {})
    kinds, skipped = applicable(None, "single", netns=False, why_not="network namespaces need root")
    assert kinds == ["kill", "crash", "pause"] and set(skipped) == {"cut", "slow"}
    assert "root" in skipped["cut"]
    assert applicable(parse_kinds("failover,kill"), "single", True) == (
        ["kill"], {"failover": "a single Redis has no replica to fail over to"})
    with pytest.raises(ValueError):
        parse_kinds("kill,flood")


def test_arguments():
    args = build_parser().parse_args(["bench", "soak", "--topology", "cluster", "--faults", "kill,crash"])
    assert (args.topology, args.faults, args.cut_s, args.pause_s, args.netns) == ("cluster", "kill,crash", 45, 40, "auto")
    assert min_replicas(args) == 1 and replica_env(args)["RKV_REDIS_MIN_REPLICAS"] == "1"
    single = build_parser().parse_args(["bench", "soak", "--pending-ttl-s", "30"])
    assert min_replicas(single) == 0 and replica_env(single)["RKV_REDIS_PENDING_TTL_S"] == "30"
    assert parse_range("3-20") == (3, 20) and parse_range("4") == (4, 4)
    with pytest.raises(ValueError):
        parse_range("5-2")


def _result(**over) -> dict:
    data = {
        "soak": {"topology": "sentinel", "duration_s": 10, "sessions": 2, "replicas": 2, "mode": "tiered", "budget": 32,
                 "max_tokens": 4, "host_tier_bytes": 1 << 24, "session_turns": [2, 4], "netns": True,
                 "pending_ttl_s": 10},
        "wall_s": 12.0, "turns_done": 9, "turns_replayed": 1, "turns_failed": {"connection": 2, "busy": 1},
        "acknowledged": {"durable": 7, "not_durable": 1, "not_saved": 1}, "turns_lost_not_durable": 1,
        "reconciles": 1, "diverged_told": 1,
        "requests_failed": {}, "sessions_created": 3, "deletes": 1, "sessions_surviving": 2, "turns_in_doubt": 0,
        "sessions_given_up": {},
        "faults": {"planned": {"kill": 1, "failover": 1, "cut": 1}, "done": {"kill": 1, "failover": 1},
                   "failed": {"cut": 1}, "skipped": {"slow": "no network namespaces (off)"}},
        "server": {"caches_kv_restored": 5, "caches_replayed": 2, "store_losses": 1},
        "keys_per_session": {"sessions": 2, "max": 4, "mean": 3.5}, "round_trips_per_turn": 6.2,
        "replica_logs": {"r0": {"errors": 1, "restored_history_only": 2}, "r1": {"errors": 0, "restored_history_only": 1}},
        "checks": {"history": {"sessions": 2, "turns": {"acknowledged": 9}}, "deleted": {"sessions": 1},
                   "replies": {"sessions": 2, "turns": 8, "differ": 0}, "missing_kv": {"sessions": 0},
                   "orphan_keys": {"keys": 0}, "host_slots": {"r0": {"ok": True}, "r1": {"ok": True}}},
        "violations": {"history": 0, "lost_turns": 0, "duplicated_turns": 0, "deleted_answering": 0,
                       "replies_differ": 0, "missing_kv": 0, "orphan_keys": 0, "host_slots": 0},
        "ok": True,
    }
    data.update(over)
    return data


def test_report_renders_a_soak_result_as_counts_and_checks():
    data = _result()
    assert kind(data) == "soak"
    text = "\n".join(TABLES["soak"](data))
    assert "**No violation.**" in text and "(sentinel Redis, each replica in a network namespace)" in text
    assert "Faults: 1 kill, 1 failover (1 cut failed); slow skipped: no network namespaces (off)." in text
    for row in ("| turn attempts failed: `connection` | 2 |", "| acknowledged durable (fsynced or replicated) | 7 |",
                "| acknowledged not durable, then lost (the client was told) | 1 |", "| fault: failover | 1 |",
                "| caches rebuilt by replaying their feeds | 2 |", "| Redis keys per live session: mean / max | 3.5 / 4 (2 sessions) |",
                "| Redis round trips per acknowledged turn (housekeeping included) | 6.2 |",
                "| restores of a record without KV (cache prefilled from the whole history) | 3 |",
                "| deleted sessions answering on a replica | 1 sessions | 0 |",
                "| acknowledged durable turns lost | 9 turns | 0 |",
                "| sessions whose replies differ from a reference run without faults | 2 sessions, 8 turns | 0 |"):
        assert row in text, row
    bad = "\n".join(TABLES["soak"](_result(ok=False, violations={**data["violations"], "orphan_keys": 3})))
    assert "**Violations found.**" in bad
    assert "| Redis keys of the session namespace without a live record | every key, after the pending TTL | 3 |" in bad


def test_report_still_renders_the_first_soak_file():
    from bench.results import RESULTS, load

    text = "\n".join(TABLES["soak"](load(RESULTS / "soak" / "32x600s.json").data))
    assert "9 replica restarts (kill -9), 1 Redis restart(s)" in text and "| acknowledged turns lost | 218 turns | 0 |" in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server for its private Redis")
def test_a_short_soak_runs_its_faults_and_checks(tmp_path):
    """Two clients, two replicas on one Redis, a replica killed and Redis crashed: the run ends, counts what it
    did, checks every surviving session (the reference run replays them) and exits 1 exactly when it reports
    a violation."""
    out = tmp_path / "soak.json"
    args = build_parser().parse_args([
        "bench", "soak", "--duration", "16", "--sessions", "2", "--replicas", "2", "--faults", "crash,kill",
        "--fault-every", "5", "--replica-down-s", "0.5", "--settle-s", "1", "--netns", "off",
        "--pending-ttl-s", "10", "--session-turns", "2-4", "--drain", "20", "--json", str(out), "--quiet",
    ])
    code = args.func(args)
    data = json.loads(out.read_text())
    assert data["turns_done"] > 0 and data["sessions_created"] >= 2
    assert data["faults"]["done"].get("kill", 0) >= 1 and data["faults"]["done"].get("crash", 0) >= 1
    assert not data["faults"]["failed"] and set(data["faults"]["skipped"]) == set()
    assert data["quiesced"]
    assert sum(data["acknowledged"]["by_durability"].values()) == data["turns_done"]
    assert data["checks"]["history"]["sessions"] == data["sessions_surviving"]
    assert data["checks"]["replies"]["sessions"] + data["checks"]["history"]["lost_sessions"] <= data["sessions_surviving"]
    assert data["keys_per_session"]["sessions"] >= 0 and data["round_trips_per_turn"] > 0
    assert set(data["checks"]["host_slots"]) == {"r0", "r1"}
    assert code == (0 if data["ok"] else 1) and data["ok"] == (not any(data["violations"].values()))


async def test_a_teacher_forced_transcript_scores_its_own_greedy_tokens_as_top_and_a_swapped_one_far_below(make_engine):
    """The reference run's check of a differing reply (``bench.soak_forced``): the engine's own greedy turns,
    fed back through a fresh cache of the same mode, are the top logit at every position (within float
    noise); a token swapped for an unlikely one is far below it: what wrong KV would show."""
    from app.engine.sampling import SamplingParams
    from bench.soak_forced import MARGIN, gaps, transcript_of

    engine = make_engine(mode="tiered", token_budget=32, page_tokens=8)
    session = engine.create_session(mode="tiered")
    for text in ("The lighthouse keeper wrote about the storm and the gulls. " * 4, "What did he write about?"):
        await engine.complete(session.id, text, SamplingParams(max_tokens=4))
    stats = [{"prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens} for t in session.turns]
    transcript = transcript_of(list(session.token_ids), stats)
    assert max(gaps(engine, "tiered", transcript, 1, 4)) <= MARGIN
    last_reply = transcript.turns[1][0] + 1
    transcript.ids[last_reply] = (transcript.ids[last_reply] + 7919) % 49152  # an unlikely token
    assert max(gaps(engine, "tiered", transcript, 1, 4)) > 1.0
