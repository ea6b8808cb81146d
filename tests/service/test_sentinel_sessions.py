"""Sessions on a Redis primary behind Sentinel (``redis+sentinel://``): every save waits for the replica and
says so (durable), a failover loses no turn acknowledged as durable, the replicas follow the new primary,
and another replica restores the session from it with its KV. Real model; a private primary, replica and
three sentinels on loopback."""
from __future__ import annotations

import asyncio
import secrets
import time

import pytest
from redis_sentinel import RedisSentinel, missing_reason
from replica_helpers import LONG, new_session, replica, turn

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))


async def saved(service, sid: str, timeout: float = 30) -> None:
    """Until the service's housekeeping has saved the session (Redis took it again)."""
    deadline = time.monotonic() + timeout
    while not service.repository.stored(sid):
        assert time.monotonic() < deadline, "never saved"
        await service.repository.save_unsaved(service.access.digest)
        await asyncio.sleep(0.2)


async def test_sessions_follow_a_failover_and_keep_every_durable_turn(make_engine, tmp_path):
    with RedisSentinel(tmp_path) as sentinel:
        ns = f"rkvsent-{secrets.token_hex(3)}"
        a, b = (replica(make_engine, sentinel.url, ns, name, redis_min_replicas=1, redis_retry_s=0.2)
                for name in ("a", "b"))
        try:
            sid, token = await new_session(a)
            durable = await turn(a, sid, token, "What did the keeper write about?")
            assert durable.storage.durable and durable.storage.durability == "replicated"
            old = sentinel.primary_port()
            assert sentinel.failover() != old
            # The first call may still reach the old primary (now a replica): it fails, the pool asks the
            # sentinels again, and housekeeping saves what that turn could not.
            await turn(a, sid, token, "And the gulls?")
            await saved(a, sid)
            stored = sentinel.client().hget(f"{ns}:session:{{{sid}}}", "tag")
            assert stored is not None and stored.decode() == a.repository._head[sid]
            fed = a.engine.sessions[sid].fed_tokens
            moved = await turn(b, sid, token, "And the ships?")  # restored from the new primary, KV and all
            assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed and moved.storage.durable
            users = [m["content"] for m in (await b.get_session(sid, token))["messages"] if m["role"] == "user"]
            assert users == [LONG, "What did the keeper write about?", "And the gulls?", "And the ships?"]
        finally:
            await a.close()
            await b.close()
