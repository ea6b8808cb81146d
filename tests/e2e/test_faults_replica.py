"""A replica killed mid-turn: its sessions resume on another replica from Redis, every finished turn kept.

The victim is a real ``rocketkv-mt serve --no-ray`` process, killed with SIGKILL (no chance to save
anything) while it streams a reply; the survivor is a server in this process on the same Redis.
(``test_ray_affinity`` covers the same under Ray Serve, with the router moving the sessions.)
"""
from __future__ import annotations

import uuid

import httpx
import pytest
from serving_helpers import (
    WsChat, local_server, server_process, session_detail, turn_until_done,
)
from websockets.exceptions import ConnectionClosed

from tiers.store.redis.keys import kv_key


async def test_a_replica_killed_mid_turn_loses_no_finished_turn(loaded, redis_url):
    import redis

    namespace = f"rkv-kill-{uuid.uuid4().hex[:8]}"
    env = {"RKV_redis_url": redis_url, "RKV_REDIS_NAMESPACE": namespace, "RKV_REPLICA_ID": "victim",
           "RKV_MAX_NEW_TOKENS": "8"}
    try:
        with local_server(loaded, replica_id="survivor", redis_url=redis_url, redis_namespace=namespace) as survivor:
            with server_process("--no-ray", env=env) as victim:
                async with WsChat.open(victim.ws_url) as t, WsChat.open(victim.ws_url) as f:
                    infos = [await t.create(mode="tiered", budget=32), await f.create(mode="full")]
                    for chat in (t, f):
                        await turn_until_done(chat, "My cat is called Miso.")
                        await turn_until_done(chat, "She is three years old.")
                    before = [session_detail(victim.url, info, timeout=60) for info in infos]

                    await t.send({"type": "message", "content": "Tell me a long story about Miso.", "max_tokens": 300})
                    assert (await t.recv())["type"] == "delta"
                    victim.kill()
                    with pytest.raises(ConnectionClosed):
                        while True:
                            await t.recv(timeout=30)

            for info, old in zip(infos, before):
                async with WsChat.open(survivor.ws_url) as chat:
                    await chat.send({"type": "session.resume", "session_id": info["session_id"],
                                     "token": info["token"]})
                    event = await chat.recv()
                    assert event["type"] == "session" and event["restored"] and event["replica"] == "survivor"
                    # Both finished turns came along; the turn cut off by the kill was never committed.
                    assert session_detail(survivor.url, info, timeout=60)["messages"] == old["messages"]
                    # The tiered session's cut-off turn may have freed cold chunks its stored KV refers
                    # to; then its history is re-prefilled rather than attended with KV that is gone.
                    _, done = await turn_until_done(chat, "What is my cat called?")
                    assert done["usage"]["prompt_tokens"] > old["history_tokens"]
                assert len(session_detail(survivor.url, info, timeout=60)["messages"]) == 6
    finally:
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(match=f"{namespace}:*"):
            r.delete(key)


async def test_a_stored_kv_with_chunks_gone_is_re_prefilled_not_trusted(loaded, redis_url):
    """What a store that lost writes can leave behind, made on purpose: a cold page the stored KV names is
    gone from its group."""
    import redis

    namespace = f"rkv-kill-{uuid.uuid4().hex[:8]}"
    settings = {"redis_url": redis_url, "redis_namespace": namespace}
    r = redis.Redis.from_url(redis_url)
    try:
        with local_server(loaded, replica_id="a", **settings) as a:
            async with WsChat.open(a.ws_url) as chat:
                info = await chat.create(mode="tiered", budget=16)
                await turn_until_done(chat, "The lighthouse keeper wrote about the storm and the gulls. " * 4)
        groups = [k for k in r.scan_iter(match=kv_key(namespace, info["session_id"], "p*"))]
        assert groups, "the test needs cold pages in Redis"
        r.hdel(groups[0], r.hkeys(groups[0])[0])  # one page of a turn's group is gone, the rest is there
        with local_server(loaded, replica_id="b", **settings) as b:
            async with WsChat.open(b.ws_url) as chat:
                await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
                assert (await chat.recv())["restored"] is True
                _, done = await turn_until_done(chat, "What did the keeper write about?")
                assert done["usage"]["prefilled_tokens"] == done["usage"]["prompt_tokens"]  # rebuilt, not trusted
            stats = httpx.get(f"{b.url}/v1/stats").json()
            assert stats["caches_kv_restore_failed"] == 1 and not stats["caches_kv_restored"]
    finally:
        for key in r.scan_iter(match=f"{namespace}:*"):
            r.delete(key)
