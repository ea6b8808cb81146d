"""The host tier is a hard bound with no Redis to spill to: a tiered turn whose demotions would not fit is
refused before it runs (``host_memory_exhausted``), the session unchanged, and the stats count it."""
import pytest

from app.contract.errors import ChatError
from app.engine.sampling import SamplingParams
from bench.haystack import hide

pytestmark = pytest.mark.slow
PROMPT = hide(["The pass key for the red door is 41735."], 1200, [0.5], seed=3) + "\n\nWhat is the pass key?"
PARAMS = SamplingParams(max_tokens=8)


async def refused(engine, session, text=PROMPT) -> ChatError:
    with pytest.raises(ChatError) as caught:
        await engine.complete(session.id, text, PARAMS)
    assert caught.value.code == "host_memory_exhausted", caught.value
    return caught.value


async def test_three_long_tiered_sessions_with_a_one_mib_host_tier_and_no_redis_stay_within_it(make_engine):
    # Measured before the bound held: these three sessions put 136,937,472 bytes in a 1 MiB host tier.
    engine = make_engine(mode="tiered", host_tier_bytes=1 << 20)
    sessions = [engine.create_session() for _ in range(3)]
    for session in sessions:
        error = await refused(engine, session)
        assert "host tier" in error.message and "1048576" in error.message
        assert session.messages == [] and session.token_ids == [] and not session.busy  # unchanged
        assert engine.host_tier.stats.bytes <= engine.host_tier.capacity_bytes
    stats = engine.stats()
    assert stats["turns_refused_host_memory"] == 3 and stats["host_capacity_bytes"] == 1 << 20
    assert stats["host_bytes_reserved"] == 0
    full = engine.create_session(mode="full")  # modes that keep nothing cold are not held back
    assert (await engine.complete(full.id, PROMPT, PARAMS)).usage.generated_tokens > 0


async def test_a_host_tier_that_holds_one_session_refuses_the_next_until_room_is_freed(make_engine):
    probe = make_engine(mode="tiered")
    session = probe.create_session()
    prompt_ids = probe._turn_ids(session, PROMPT)
    turn = probe.memory_account.turn_size(session, len(prompt_ids), PARAMS.max_tokens)
    need = probe.host_memory.pages(session, turn) * probe.host_tier.page_bytes
    assert need > 0

    engine = make_engine(mode="tiered", host_tier_bytes=need * 3 // 2)
    host = engine.host_tier
    first, second = engine.create_session(), engine.create_session()
    done = await engine.complete(first.id, PROMPT, PARAMS)
    assert done.memory.host_bytes > 0 and 0 < host.stats.bytes <= need
    await refused(engine, second)
    assert second.messages == [] and second.token_ids == []
    assert host.stats.bytes <= host.capacity_bytes and engine.stats()["turns_refused_host_memory"] == 1
    await engine.delete_session(first.id)  # its pages go: room for the other
    assert host.stats.bytes == 0
    done = await engine.complete(second.id, PROMPT, PARAMS)
    assert done.usage.generated_tokens > 0 and done.memory.host_bytes > 0
    assert host.stats.bytes <= host.capacity_bytes and engine.stats()["host_bytes_reserved"] == 0
    assert [m["role"] for m in second.messages] == ["user", "assistant"]


async def test_a_refused_turn_reaches_the_client_as_a_structured_error_and_the_metrics(loaded):
    import httpx
    from serving_helpers import WsChat, local_server, session_detail

    with local_server(loaded, mode="tiered", host_tier_bytes=1 << 20) as srv:
        async with WsChat.open(srv.ws_url) as chat:
            info = await chat.create()
            deltas, event = await chat.turn(PROMPT)
            assert deltas == [] and event["type"] == "error" and event["code"] == "host_memory_exhausted", event
            assert session_detail(srv.url, info)["messages"] == []  # the session is as it was
        stats = httpx.get(f"{srv.url}/v1/stats").json()
        assert stats["turns_refused_host_memory"] == 1 and stats["host_bytes"] <= stats["host_capacity_bytes"] == 1 << 20
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert "rkv_host_memory_refusals_total 1.0" in metrics
        assert 'rkv_errors_total{code="host_memory_exhausted"} 1.0' in metrics
        assert "rkv_host_tier_capacity_bytes 1.048576e+06" in metrics


@pytest.mark.parametrize("reselect", ["digest", "exhaustive"])
async def test_no_turn_writes_more_host_pages_than_its_admission_held(make_engine, reselect):
    """The hold is an upper bound of each turn's new pages (first turn, short and long later ones, and
    the exhaustive re-selection, which may promote every cold token): a turn admitted never finds the
    host tier full half way."""
    engine = make_engine(mode="tiered", token_budget=128, reselect=reselect)
    session = engine.create_session()
    texts = [PROMPT, "What is the key?", hide(["The blue door opens at 9."], 400, [0.5], seed=4) + " When?",
             "Thanks.", "Say the key once more."]
    for text in texts:
        n_new = len(engine._turn_ids(session, text))
        held = engine.host_memory.pages(session, engine.memory_account.turn_size(session, n_new, PARAMS.max_tokens))
        before = engine.host_tier.stats.entries
        await engine.complete(session.id, text, PARAMS)
        written = engine.host_tier.stats.entries - before
        assert 0 <= written <= held, (text[:20], written, held)
    assert engine.host_tier.stats.entries > 0
