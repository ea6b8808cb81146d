"""A ``tiered`` session parked off a replica's full device is let go once Redis has its state, reported
released (so the router places its next turn by room, ``app.placement``), and another replica restores it
at that turn without re-prefilling its history. Real model; two services on one Redis stand for two
replicas of one deployment."""
from __future__ import annotations

import asyncio
import secrets
import time

from replica_helpers import turn

from app.chat_service import ChatService
from app.contract.ids import new_session_id
from app.placement import Candidate, Room, holds, place
from app.session_store import SessionStore

LONG = "The lighthouse keeper wrote about the storm, the gulls and the ships that passed by. " * 6
OTHER = "A baker in the valley rose before dawn to knead the bread for the whole village. " * 6


def replica(make_engine, url: str, ns: str, name: str) -> ChatService:
    # Whole prefills: a chunked one's bound holds every new token in every layer at once.
    engine = make_engine(mode="tiered", token_budget=32, page_tokens=8, prefill_chunk=0, redis_url=url,
                         redis_namespace=ns)
    return ChatService(engine, name, SessionStore(engine.redis.client, ns))


async def new_session(service: ChatService) -> tuple[str, str]:
    sid = new_session_id()
    return sid, (await service.create_session(sid, mode="tiered"))["token"]


async def test_a_parked_session_is_let_go_and_another_replica_restores_it_without_reprefill(make_engine, private_redis):
    ns = f"rkvmove-{secrets.token_hex(3)}"
    a, b = replica(make_engine, private_redis.url, ns, "a"), replica(make_engine, private_redis.url, ns, "b")
    try:
        first, first_token = await new_session(a)
        await turn(a, first, first_token, LONG)
        fed = a.engine.sessions[first].fed_tokens
        second, second_token = await new_session(a)
        # The budget of a: the first session's device bytes and the second's first turn, less one byte,
        # so that turn is admitted only once the first session is parked.
        mem, session = a.engine.memory_account, a.engine.sessions[second]
        need = mem.turn_bound(session, len(a.engine._turn_ids(session, OTHER)), 4)
        mem.budget = mem.held[first] + need - 1
        await turn(a, second, second_token, OTHER)
        assert mem.parks == 1

        deadline = time.monotonic() + 10
        while first in a.engine.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the housekeeping lets it go (Redis has its state)
        assert first not in a.engine.sessions and second in a.engine.sessions
        stats = a.routing_stats()
        assert stats["released"] == [first]
        # Ray still lists both among a's multiplexed ids: a holds the second, not the first, whose next
        # turn goes by room, here to b.
        held = {first, second}
        assert not holds(first, held, stats) and holds(second, held, stats)
        room_b = Room(device_room=10**12, reported_at=1.0)
        fleet = [Candidate("a", holds(first, held, stats), Room.from_stats(stats)), Candidate("b", False, room_b)]
        assert place(first, fleet).key == "b"

        moved = await turn(b, first, first_token, "What did the keeper write about?")
        assert b.engine.sessions[first].cache is not None
        # Only the new turn is prefilled: the history's KV came back from Redis.
        assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed < 40
        assert first not in b.routing_stats()["released"]
    finally:
        await a.close()
        await b.close()
