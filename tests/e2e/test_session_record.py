"""One record per session in Redis: what a tiered conversation leaves there, exact resume from it in
another process, and turns sent again under their idempotency key."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from serving_helpers import RedisServer, WsChat, local_server, session_detail, turn_until_done

from app.engine.sampling import SamplingParams
from bench.haystack import hide
from tiers.cold.ids import page_names
from tiers.session_kv import table_names
from tiers.store.protocol import group_of
from tiers.store.redis.keys import kv_key, owner_key, session_key
from tiers.store.wire import unpack

LONG = "Tell me about the history of the printing press in Europe. " * 4


def referenced_items(client, namespace: str, sid: str, kv: dict) -> set[str]:
    """The KV items (``group/field``) a record's generation names: its page tables and primary sets, and
    the pages its tables list."""
    tables = set(table_names(kv["gen"], kv["layers"]))
    pages = set()
    for layer in range(kv["layers"]):
        index = unpack(client.hget(kv_key(namespace, sid, f"g{kv['gen']}"), f"index{layer}"))
        pages |= set(page_names(layer, index))
    return tables | pages


async def test_a_tiered_conversation_leaves_one_record_and_its_kv_pages_nothing_else(loaded, tmp_path):
    namespace = f"rkv-rec-{uuid.uuid4().hex[:6]}"
    with RedisServer(tmp_path) as redis_server:
        with local_server(loaded, redis_url=redis_server.url, redis_namespace=namespace) as srv:
            async with WsChat.open(srv.ws_url) as chat:
                info = await chat.create(mode="tiered", budget=16)
                for text in (LONG, "And in Asia?", "Thanks."):
                    await turn_until_done(chat, text)
            client, sid = redis_server.client(), info["session_id"]
            keys = {k.decode() for k in client.scan_iter(count=1000)}
            record_key = session_key(namespace, sid)
            kv_keys = {k for k in keys if k.startswith(kv_key(namespace, sid, ""))}
            # The record, its KV groups, the listing index and its bytes, the replicas' totals: nothing else.
            index = owner_key(namespace, None)
            assert keys == {record_key, index, f"{index}:bytes", f"{namespace}:replicas"} | kv_keys
            # Written once at creation and once per turn, compare-and-set: each save drew a tag of its own.
            lineage = client.hget(record_key, "lineage").split()
            assert len(lineage) == len(set(lineage)) == 4 and client.hget(record_key, "tag") == lineage[-1]
            record = json.loads(client.hget(record_key, "data"))
            kv = record["kv"]
            assert kv["layers"] == len(kv["cold"]) > 0 and 0 < kv["history_len"] <= len(record["token_ids"])
            named = referenced_items(client, namespace, sid, kv)
            assert len(named) > 2 * kv["layers"], "the conversation should have cold pages"
            # Exactly what the record names: one generation's tables and primary sets, its pages, no orphan
            # group nor item; the record's groups, each counted whole.
            groups = {group_of(name) for name in named}
            assert kv_keys == {kv_key(namespace, sid, g) for g in groups}
            assert set(client.hget(record_key, "groups").decode().split()) == groups == set(kv["groups"])
            for group in groups:
                fields = {f.decode() for f in client.hkeys(kv_key(namespace, sid, group))}
                assert {f"{group}/{f}" for f in fields} == {n for n in named if group_of(n) == group}
                assert len(fields) == kv["groups"][group]


RUN = r"""
import asyncio, json, sys
from app.chat_service import ChatService
from app.contract.events import Delta, Done
from app.contract.ids import new_session_id
from app.engine.engine import Engine
from app.session_store import SessionStore
from app.settings import Settings

url, namespace, sid, token, texts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
engine = Engine(Settings(mode="tiered", token_budget=128, redis_url=url, redis_namespace=namespace))
service = ChatService(engine, "process", SessionStore(engine.redis.client, namespace))

async def main(sid, token):
    if sid == "new":
        sid = new_session_id()
        token = (await service.create_session(sid))["token"]
    replies = []
    for text in texts:
        events = [e async for e in service.chat(sid, token, text, {"max_tokens": 12})]
        assert isinstance(events[-1], Done), events
        replies.append("".join(e.text for e in events if isinstance(e, Delta)))
    fed = engine.sessions[sid].fed_tokens
    await service.close()
    print(json.dumps({"sid": sid, "token": token, "replies": replies, "fed": fed}))

asyncio.run(main(sid, token))
"""


def run_process(redis_url: str, namespace: str, sid: str, token: str, texts: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, redis_url, namespace, sid, token, json.dumps(texts)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "RKV_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


async def test_resume_in_a_new_process_gives_the_same_third_turn(make_engine, redis_url):
    facts = ["The pass key for the red door is 41735.", "The pass key for the blue door is 90264."]
    texts = [hide(facts, 700, [0.2, 0.7], seed=5) + "\n\nWhat is the pass key for the red door?",
             "What is the pass key for the blue door?", "Say the red door's key again."]
    namespace = f"rkvtest-{uuid.uuid4().hex[:6]}"
    try:
        first = run_process(redis_url, namespace, "new", "-", texts[:2])
        resumed = run_process(redis_url, namespace, first["sid"], first["token"], texts[2:])
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{namespace}:*"):
            client.delete(key)
    engine = make_engine(mode="tiered", token_budget=128)
    session = engine.create_session()
    replies = [(await engine.complete(session.id, text, SamplingParams(max_tokens=12))).text for text in texts]
    assert first["replies"] == replies[:2]
    assert resumed["replies"][0] == replies[2]
    # The resumed process fed only the third turn: the KV came from the record's pages, not a re-prefill.
    assert resumed["fed"] == session.fed_tokens


async def test_a_turn_sent_again_under_its_key_is_answered_not_run_again(loaded, redis_url):
    namespace = f"rkv-key-{uuid.uuid4().hex[:6]}"
    settings = {"redis_url": redis_url, "redis_namespace": namespace}
    try:
        with local_server(loaded, replica_id="a", **settings) as a:
            async with WsChat.open(a.ws_url) as chat:
                info = await chat.create(mode="tiered")
                first, done = await chat.turn("Name a colour.", idempotency_key="turn-1")
                again, same = await chat.turn("Name a colour.", idempotency_key="turn-1")
                assert done["type"] == same["type"] == "done"
                assert "".join(again) == "".join(first) and same["usage"] == done["usage"]
                assert len(session_detail(a.url, info)["messages"]) == 2  # it ran once
                await turn_until_done(chat, "Name a colour.", idempotency_key="turn-2")  # a new key runs
                assert len(session_detail(a.url, info)["messages"]) == 4
        # The key travels with the record: another replica answers it from there.
        with local_server(loaded, replica_id="b", **settings) as b:
            async with WsChat.open(b.ws_url) as chat:
                await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
                assert (await chat.recv())["restored"] is True
                _, replayed = await chat.turn("Name a colour.", idempotency_key="turn-2")
                assert replayed["type"] == "done" and replayed["replica"] == "a"
                assert len(session_detail(b.url, info)["messages"]) == 4
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{namespace}:*"):
            client.delete(key)
