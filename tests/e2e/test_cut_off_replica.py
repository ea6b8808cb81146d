"""A replica cut off from Redis for 45 s, then healed, while another replica goes on: nothing it wrote and
still needs is deleted meanwhile, so its session, saved once it is back and moved to the other replica,
comes back with its KV: no replay, no re-prefill. Its pages spilled to Redis before the cut, and the
turn that spilled them could not save (the cut came first): they were named by no record all along.
Real model; the cut replica reaches Redis through a TCP proxy the test owns, on loopback."""
from __future__ import annotations

import asyncio
import secrets

import pytest
from replica_helpers import LONG, new_session, replica, turn

from bench.tcp_proxy import ProxyProcess
from serving_helpers import free_port

CUT_S = 45.0


@pytest.mark.slow
async def test_a_replica_cut_off_for_45_s_finds_what_it_wrote_and_its_session_moves_without_replay(
        make_engine, private_redis, tmp_path):
    port = free_port()
    proxy = ProxyProcess([("127.0.0.1", port, "127.0.0.1", private_redis.port)], tmp_path / "proxy.sock",
                         tmp_path / "proxy.log")
    proxy.start()
    ns = f"rkvcut-{secrets.token_hex(3)}"
    # A's host tier holds a fraction of a session's pages: its turns spill to Redis.
    a = replica(make_engine, f"redis://127.0.0.1:{port}/0", ns, "a", host_tier_bytes=1 << 20)
    b = replica(make_engine, private_redis.url, ns, "b", host_tier_bytes=64 << 20)
    try:
        await new_session(b)  # B is up, its housekeeping running through the cut
        sid, token = await new_session(a)
        commit = a.store.save

        async def cut_first(*args, **kwargs):
            proxy.cut()  # the turn's pages spilled and its KV written; its record's commit is cut off
            return await commit(*args, **kwargs)

        a.store.save = cut_first
        cut = await turn(a, sid, token, LONG + " What did the keeper write about?")
        a.store.save = commit
        assert not cut.storage.saved and a.engine.host_tier.stats.spills > 0
        await asyncio.sleep(CUT_S)
        proxy.heal()
        a.engine.redis.client.breaker.succeeded()  # probe at once rather than wait out the back-off
        await a.repository.save_unsaved(a.access.digest)
        assert a.repository.stored(sid)
        fed = a.engine.sessions[sid].fed_tokens
        moved = await turn(b, sid, token, "And the gulls?")  # B restores the record A saved after the cut
        assert moved.usage.prefilled_tokens == moved.usage.prompt_tokens - fed
        assert b.engine.rebuilds["kv_restored"] == 1 and not b.engine.rebuilds["kv_restore_failed"]
        assert not b.engine.rebuilds["replayed"] and not b.engine.rebuilds["reprefilled"]
    finally:
        await a.close()
        await b.close()
        proxy.close()
