"""Redis stopped and restarted mid-conversation (a private redis-server, never the shared one).

While Redis is down, sessions keep chatting on the device and host tiers, ``/healthz`` says
``degraded`` and counts the sessions not saved yet; once it is back those are saved without
waiting for another turn, and a fresh replica restores every session with every turn.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import torch
from serving_helpers import BlackHole, RedisServer, WsChat, local_server, session_detail, turn_until_done

from tiers.cold.ids import page_id
from tiers.host.tier import HostFull, HostTier
from tiers.store.redis.client import RedisClient
from tiers.store.redis.keys import session_key
from tiers.store.redis.pages import RedisPageStore


def health(server) -> dict:
    r = httpx.get(f"{server.url}/healthz", timeout=30)
    assert r.status_code == 200  # degraded is still 200: the replica serves
    return r.json()


def messages(server, info) -> list[dict]:
    return session_detail(server.url, info)["messages"]


def stored_messages(redis_server: RedisServer, namespace: str, info) -> list[dict] | None:
    raw = redis_server.client().hget(session_key(namespace, info["session_id"]), "data")
    return None if raw is None else json.loads(raw)["messages"]


async def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)
    return value


async def test_redis_stopped_and_restarted_mid_conversation(loaded, tmp_path):
    namespace = f"rkv-fault-{uuid.uuid4().hex[:6]}"
    with RedisServer(tmp_path) as redis_server:
        settings = {"redis_url": redis_server.url, "redis_namespace": namespace}
        with local_server(loaded, replica_id="a", **settings) as srv:
            assert health(srv)["status"] == "ok" and health(srv)["redis"] == {"ok": True}
            async with WsChat.open(srv.ws_url) as t, WsChat.open(srv.ws_url) as f:
                infos = [await t.create(mode="tiered", budget=32), await f.create(mode="full")]
                for chat in (t, f):
                    await turn_until_done(chat, "My favourite colour is teal. Remember it.")
                    await turn_until_done(chat, "I also like the number 12.")

                redis_server.stop()
                for chat in (t, f):  # nothing to do with Redis: the sessions go on
                    _, done = await turn_until_done(chat, "What do I like?")
                    assert done["usage"]["prefilled_tokens"] < done["usage"]["prompt_tokens"] // 2
                async with WsChat.open(srv.ws_url) as n:
                    infos.append(await n.create(mode="tiered"))  # new sessions too
                    await turn_until_done(n, "Hello during the outage.")
                down = health(srv)
                assert down["status"] == "degraded" and down["redis"]["ok"] is False and down["redis"]["error"]
                assert down["unsaved_sessions"] == 3
                during = [messages(srv, info) for info in infos]

                redis_server.start()
                up = await wait_for(lambda: (h := health(srv))["status"] == "ok" and h["unsaved_sessions"] == 0 and h)
                assert up["redis"] == {"ok": True}
                # Saved by the retry, not by a new turn: Redis holds what was said during the outage.
                for info, said in zip(infos, during):
                    assert stored_messages(redis_server, namespace, info) == said
                for chat in (t, f):
                    await turn_until_done(chat, "Thanks, bye.")
            final = [messages(srv, info) for info in infos]
            assert [len(m) for m in final] == [8, 8, 2]

        # Another replica, starting from nothing but Redis, has every turn of every session.
        with local_server(loaded, replica_id="b", **settings) as other:
            async with WsChat.open(other.ws_url) as chat:
                await chat.send({"type": "session.resume", "session_id": infos[0]["session_id"],
                                 "token": infos[0]["token"]})
                assert (await chat.recv())["restored"] is True
                _, done = await turn_until_done(chat, "One more thing.")
                assert done["replica"] == "b"
            assert messages(other, infos[0])[:-2] == final[0]
            for info, said in zip(infos[1:], final[1:]):
                assert messages(other, info) == said


def _page(seed: int, p: int = 8, d: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(1, p, d, generator=g), "values": torch.randn(1, p, d, generator=g)}


def test_the_host_tier_refuses_past_its_bound_while_redis_is_down_and_spills_again_after(tmp_path):
    """Spilling resumes once a probe finds Redis back: pages refused while it was down were never taken
    (the caller keeps them), the bound held throughout, and none of the pages taken is lost."""
    with RedisServer(tmp_path) as redis_server:
        tier = RedisPageStore(RedisClient(redis_server.url, timeout_s=0.5, retry_s=0.2),
                              namespace=f"rkv-spill-{uuid.uuid4().hex[:6]}")
        host = HostTier(capacity_bytes=2 * 2 * 8 * 16 * 4, store=tier)
        pids = [page_id(0, 1, 0, i) for i in range(8)]
        try:
            pages = {i: _page(i) for i in range(8)}
            for i in range(3):
                host.put_many("s", [pids[i]], pages[i])
            assert host.stats.spills == 1

            redis_server.stop()
            for i in range(3, 6):
                with pytest.raises(HostFull):
                    host.put_many("s", [pids[i]], pages[i])
            assert host.stats.bytes <= host.capacity_bytes and not tier.client.healthy and tier.last_error
            assert tier.client.breaker.opened == 1  # one failure opened it; the others failed at once

            redis_server.start()
            time.sleep(0.3)  # past the circuit's backoff: the next spill is its probe
            for i in range(6, 8):
                host.put_many("s", [pids[i]], pages[i])
            assert host.stats.spills == 3 and tier.client.healthy and tier.client.breaker.state == "closed"
            for i, page in pages.items():  # every page taken readable, from wherever it is
                if i in (3, 4, 5):
                    assert host.where_many("s", [pids[i]]) == ["none"]
                    continue
                got, _ = host.read_many("s", [pids[i]])
                assert torch.equal(got["keys"], page["keys"]) and torch.equal(got["values"], page["values"])
            assert host.stats.bytes <= host.capacity_bytes
        finally:
            tier.close()


def test_healthz_answers_degraded_at_once_while_redis_accepts_and_never_answers(loaded):
    """A Redis that hangs (here: a socket that accepts and never answers) must not hang the health
    probe: ``/healthz`` says ``degraded`` within a second, every time, and ``/metrics`` shows the open
    circuit once the first call's timeout opened it."""
    with BlackHole() as hole, local_server(loaded, redis_url=hole.url, redis_timeout_s=1.0) as srv:
        for _ in range(4):
            start = time.monotonic()
            r = httpx.get(f"{srv.url}/healthz", timeout=5)
            assert time.monotonic() - start < 1.0
            assert r.status_code == 200 and r.json()["status"] == "degraded" and r.json()["redis"]["ok"] is False
            time.sleep(0.5)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=5).text
        assert "rkv_redis_circuit_open 1.0" in metrics and "rkv_redis_circuit_opens_total 1.0" in metrics
