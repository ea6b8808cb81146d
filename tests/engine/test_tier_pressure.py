"""A tiered session under host-tier pressure gives the same replies as one with room to spare, and is
refused, unchanged, when Redis goes and its cold history no longer fits anywhere.

The host tier is smaller than one layer's cold history, so every turn spills pages to Redis and reads
pages back from it, often more in one read than the pool holds. A page handed to attention must still
be the page that was written (no view of a slot that a later read reuses).
"""
import secrets

import pytest

from app.engine.errors import HostMemoryExhausted
from app.engine.replay import replayable
from app.engine.sampling import SamplingParams
from bench.haystack import hide
from serving_helpers import RedisServer

pytestmark = pytest.mark.slow
FACTS = ["The pass key for the red door is 41735.", "The pass key for the green door is 52816.",
         "The pass key for the blue door is 90264."]
FIRST = hide(FACTS, 1600, [0.1, 0.5, 0.85], seed=11) + "\n\nWhat is the pass key for the red door?"
LATER = ["What is the pass key for the green door?", "And the blue door?"]
PARAMS = SamplingParams(max_tokens=16)
TIGHT = 1 << 20  # the smallest host tier the settings allow: 64 pages of the bundled model


async def run(engine, stop_after_first=None):
    session = engine.create_session(mode="tiered")
    dones = []
    for i, text in enumerate([FIRST, *LATER]):
        dones.append(await engine.complete(session.id, text, PARAMS))
        if i == 0 and stop_after_first is not None:
            stop_after_first()
    return session, dones


async def test_a_host_tier_smaller_than_one_layers_cold_history_changes_no_reply(make_engine, tmp_path):
    roomy, roomy_done = await run(make_engine())
    history = roomy_done[0].usage.prompt_tokens
    one_layer_cold = (history - roomy.cache.kept_tokens()) * 3 * 64 * 2 * 4
    assert TIGHT < one_layer_cold
    # The session's log accounts for every token its cache was fed: one feed per turn.
    assert len(roomy.feeds) == 3 and replayable(roomy.feeds, roomy.cache.history_len)

    with RedisServer(tmp_path) as redis_server:
        engine = make_engine(redis_url=redis_server.url, redis_namespace=f"rkvtest-{secrets.token_hex(3)}",
                             host_tier_bytes=TIGHT)
        tight, dones = await run(engine)
        assert tight.token_ids == roomy.token_ids
        host = engine.host_tier
        assert host.stats.spills > 0 and host.stats.bytes <= TIGHT
        assert all(d.memory.redis_bytes_read > 0 for d in dones[1:])  # later turns read pages back from Redis
        await engine.delete_session(tight.id)

        # Redis stops after the first turn. The pages only Redis held are gone with it, and rebuilding the
        # cache would take far more than the host tier holds, with nowhere to spill: the next turn is
        # refused with host_memory_exhausted, the session as it was, the host tier within its bound.
        engine = make_engine(redis_url=redis_server.url, redis_namespace=f"rkvtest-{secrets.token_hex(3)}",
                             host_tier_bytes=TIGHT, redis_timeout_s=0.3)
        session = engine.create_session(mode="tiered")
        await engine.complete(session.id, FIRST, PARAMS)
        redis_server.stop()
        before = list(session.messages), list(session.token_ids)
        with pytest.raises(HostMemoryExhausted):
            await engine.complete(session.id, LATER[0], PARAMS)
        assert (session.messages, session.token_ids) == before and not session.busy
        assert engine.host_tier.stats.bytes <= TIGHT and not engine.redis.client.healthy
        assert engine.stats()["turns_refused_host_memory"] == 1
