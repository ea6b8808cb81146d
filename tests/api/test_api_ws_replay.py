"""A turn that first rebuilds its session's lost cache tells the WebSocket client how far it is: `status`
events, before the reply's first delta (real server on loopback, in-process engine, the suite's Redis)."""
from __future__ import annotations

import secrets

from serving_helpers import WsChat, local_server, turn_until_done

from bench.haystack import hide
from tiers.store.redis.keys import kv_key

TURNS = [hide(["The pass key for the red door is 41735."], 300, [0.4], seed=3) + "\n\nWhat is the red door's key?",
         "Say it again."]


async def test_a_replay_streams_its_progress_before_the_reply(loaded, redis_url):
    import redis

    namespace = f"rkvtest-{secrets.token_hex(3)}"
    client = redis.Redis.from_url(redis_url)
    # A tiered session whose cold pages nearly all spill to Redis (a host tier of 128 pages of 16 tokens).
    settings = {"mode": "tiered", "token_budget": 64, "page_tokens": 16, "host_tier_bytes": 1 << 20,
                "redis_url": redis_url, "redis_namespace": namespace}
    try:
        with local_server(loaded, **settings) as server:
            async with WsChat.open(server.ws_url) as chat:
                info = await chat.create()
                for text in TURNS:
                    await turn_until_done(chat, text)
                # Redis loses the session's pages (an empty restart): the next turn replays the two turns.
                pages = list(client.scan_iter(match=kv_key(namespace, info["session_id"], "*")))
                assert pages
                client.delete(*pages)
                await chat.send({"type": "message", "content": "Thanks!", "max_tokens": 8})
                events = [await chat.recv()]
                while events[-1]["type"] not in ("done", "error"):
                    events.append(await chat.recv())
    finally:
        for key in client.scan_iter(match=f"{namespace}:*"):
            client.delete(key)
    n = len(TURNS)
    assert [e["type"] for e in events[: n + 1]] == ["status"] * (n + 1), events
    assert [(e["stage"], e["done"], e["total"]) for e in events[: n + 1]] == [("replay", i, n) for i in range(n + 1)]
    assert events[n]["tokens"] == events[n]["total_tokens"] > events[0]["tokens"] == 0
    assert {e["type"] for e in events[n + 1 : -1]} <= {"delta"} and events[-1]["type"] == "done"
    assert events[-1]["usage"]["prefilled_tokens"] == events[-1]["usage"]["prompt_tokens"]
