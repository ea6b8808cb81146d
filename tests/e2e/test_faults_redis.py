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
import torch
from serving_helpers import RedisServer, WsChat, local_server, session_detail, turn_until_done

from tiers.host import HostTier
from tiers.redis_client import RedisClient
from tiers.redis_tier import RedisTier


def health(server) -> dict:
    r = httpx.get(f"{server.url}/healthz", timeout=30)
    assert r.status_code == 200  # degraded is still 200: the replica serves
    return r.json()


def messages(server, info) -> list[dict]:
    return session_detail(server.url, info)["messages"]


def stored_messages(redis_server: RedisServer, namespace: str, info) -> list[dict] | None:
    raw = redis_server.client().hget(f"{namespace}:session:{info['session_id']}", "data")
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


def test_the_host_tier_overflows_while_redis_is_down_and_spills_again_after(tmp_path):
    """Spilling resumes: pages pushed while Redis is down stay in host memory (over the bound), none lost."""
    with RedisServer(tmp_path) as redis_server:
        tier = RedisTier(RedisClient(redis_server.url, timeout_s=0.5), namespace=f"rkv-spill-{uuid.uuid4().hex[:6]}")
        host = HostTier(capacity_bytes=2 * 2 * 8 * 16 * 4, redis=tier)
        try:
            pages = {i: _page(i) for i in range(8)}
            for i in range(3):
                host.put_many("s", [f"c{i}"], pages[i])
            assert host.stats.spills == 1 and host.overflow_slots == 0

            redis_server.stop()
            for i in range(3, 6):
                host.put_many("s", [f"c{i}"], pages[i])
            assert host.overflow_slots == 3 and not tier.healthy and tier.last_error

            redis_server.start()
            for i in range(6, 8):
                host.put_many("s", [f"c{i}"], pages[i])
            assert host.stats.spills == 3 and tier.healthy  # spilling again, the pool no longer grows
            assert host.overflow_slots == 3
            for i, page in pages.items():  # every page readable, from wherever it is
                got, _ = host.read_many("s", [f"c{i}"])
                assert torch.equal(got["keys"], page["keys"]) and torch.equal(got["values"], page["values"])
        finally:
            tier.close()
