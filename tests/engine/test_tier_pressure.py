"""A tiered session under host-tier pressure gives the same replies as one with room to spare.

The host tier is smaller than one layer's cold history, so every turn spills pages to Redis and reads
pages back from it, often more in one read than the pool holds. A page handed to attention must still
be the page that was written (no view of a slot that a later read reuses).
"""
import secrets

import pytest

from app.engine.replay import replayable
from app.engine.sampling import SamplingParams
from bench.haystack import hide
from serving_helpers import RedisServer

pytestmark = pytest.mark.slow
FACTS = ["The pass key for the red door is 41735.", "The pass key for the green door is 52816.",
         "The pass key for the blue door is 90264."]
FIRST = hide(FACTS, 3300, [0.1, 0.5, 0.85], seed=11) + "\n\nWhat is the pass key for the red door?"
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
    assert history >= 4000
    one_layer_cold = (history - roomy.cache.kept_tokens()) * 3 * 64 * 2 * 4
    assert TIGHT < one_layer_cold
    assert roomy.cache.prefill.tiers.host.overflow_slots == 0
    # The session's log accounts for every token its cache was fed: one feed per turn.
    assert len(roomy.feeds) == 3 and replayable(roomy.feeds, roomy.cache.history_len)

    with RedisServer(tmp_path) as redis_server:
        engine = make_engine(redis_url=redis_server.url, redis_namespace=f"rkvtest-{secrets.token_hex(3)}",
                             host_tier_bytes=TIGHT)
        tight, dones = await run(engine)
        assert tight.token_ids == roomy.token_ids
        host = engine.host_tier
        assert host.stats.spills > 0 and host.overflow_slots == 0 and host.stats.bytes <= TIGHT
        assert all(d.memory.redis_bytes_read > 0 for d in dones[1:])  # later turns read pages back from Redis
        engine.delete_session(tight.id)

        # Redis stops after the first turn. The pages only Redis held are gone with it, so the next turn
        # rebuilds the cache by feeding the earlier turns again as they were fed (the same turn, no
        # error), and the replies stay the same; from then on pages no longer spill: the host tier
        # grows past its bound instead of losing one.
        engine = make_engine(redis_url=redis_server.url, redis_namespace=f"rkvtest-{secrets.token_hex(3)}",
                             host_tier_bytes=TIGHT)
        engine.redis.client.timeout_s = 0.3
        outage, dones = await run(engine, stop_after_first=redis_server.stop)
        assert outage.token_ids == roomy.token_ids
        assert dones[1].usage.prefilled_tokens > history and dones[2].usage.prefilled_tokens < 40
        assert all(d.usage.generated_tokens > 0 for d in dones)
        assert engine.host_tier.overflow_slots > 0 and not engine.redis.healthy
        assert [m["role"] for m in outage.messages] == ["user", "assistant"] * 3
        assert not any(m.get("error") for m in outage.messages)
