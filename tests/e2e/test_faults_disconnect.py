"""Clients that cancel or vanish mid-reply, and a second message while one is generating.

In each case generation stops within one decode step, the partial reply is stored marked
``cancelled``, no earlier turn of any session is lost, and the session goes on.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
from serving_helpers import WsChat, local_server, session_detail, turn_until_done

MODEL = "SmolLM2-135M-Instruct"
STORY = "Write a very long story about the sea, with many chapters."


@pytest.fixture(scope="module")
def server(loaded):
    with local_server(loaded) as srv:
        yield srv


async def wait_idle(server, info) -> dict:
    for _ in range(200):
        d = session_detail(server.url, info)
        if not d["busy"]:
            return d
        await asyncio.sleep(0.05)
    raise AssertionError("the session is still generating")


@pytest.mark.parametrize("how", ["cancel", "consumer gone"])
async def test_generation_stops_within_one_decode_step(make_engine, how):
    """Deterministic, on the serving layer: between two decode steps nothing more is generated."""
    from app.chat_service import ChatService
    from app.contract.ids import new_session_id

    service = ChatService(make_engine(), replica_id="t")
    info = await service.create_session(new_session_id(), mode="full")
    sid, token = info["session_id"], info["token"]
    session = service.engine.sessions[sid]
    events = service.chat(sid, token, STORY, {"max_tokens": 200})
    assert (await anext(events)).type == "start"
    deltas = [(await anext(events)).text for _ in range(3)]
    at_stop = len(session.token_ids)  # history + the tokens generated so far
    if how == "cancel":
        assert await service.cancel_turn(sid, token) is True
        rest = [e async for e in events]
        assert {e.type for e in rest[:-1]} <= {"delta"} and rest[-1].type == "done"
        deltas += [e.text for e in rest[:-1]]  # at most the detokenizer's held-back tail
        done = rest[-1]
        assert done.finish_reason == "cancelled"
        assert done.usage.prompt_tokens + done.usage.generated_tokens == at_stop
    else:
        await events.aclose()
        for _ in range(100):
            if not session.busy:
                break
            await asyncio.sleep(0.02)
        stats = session.turns[-1]
        assert stats.finish_reason == "cancelled" and stats.prompt_tokens + stats.generated_tokens == at_stop
    reply = session.messages[-1]
    assert reply["role"] == "assistant" and reply["cancelled"] is True
    assert reply["content"].startswith("".join(deltas[:3])) and reply["content"]
    follow = [e async for e in service.chat(sid, token, "Now just say hello.", {"max_tokens": 4})]
    assert follow[-1].type == "done" and follow[-1].finish_reason in ("stop", "length")
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    await service.close()


async def test_a_client_dropped_mid_stream_loses_no_earlier_turn(server):
    async with WsChat.open(server.ws_url) as a, WsChat.open(server.ws_url) as b, WsChat.open(server.ws_url) as c:
        infos = [await chat.create(mode=mode) for chat, mode in ((a, "tiered"), (b, "full"), (c, "snapkv"))]
        for i, chat in enumerate((a, b, c)):
            await turn_until_done(chat, f"My lucky number is {i + 3}.")
        before = [session_detail(server.url, info)["messages"] for info in infos]

        async def drop_mid_stream() -> str:
            async with WsChat.open(server.ws_url) as gone:
                await gone.send({"type": "session.resume", "session_id": infos[0]["session_id"],
                                 "token": infos[0]["token"]})
                assert (await gone.recv())["type"] == "session"
                await gone.send({"type": "message", "content": STORY, "max_tokens": 300})
                first = await gone.recv()
                assert first["type"] == "delta"
                return first["text"]  # leaving the block closes the socket mid-reply

        await a.ws.close()
        received, *others = await asyncio.gather(
            drop_mid_stream(), turn_until_done(b, "And yours?"), turn_until_done(c, "And yours?"))

    dropped = await wait_idle(server, infos[0])
    assert dropped["messages"][:2] == before[0]
    assert dropped["messages"][2] == {"role": "user", "content": STORY}
    partial = dropped["messages"][3]
    assert partial["cancelled"] is True and partial["content"].startswith(received)
    last = dropped["turn_stats"][-1]
    assert last["finish_reason"] == "cancelled" and last["generated_tokens"] < 300
    for info, old in zip(infos[1:], before[1:]):
        messages = session_detail(server.url, info)["messages"]
        assert messages[:2] == old and len(messages) == 4

    async with WsChat.open(server.ws_url) as chat:
        await chat.send({"type": "session.resume", "session_id": infos[0]["session_id"], "token": infos[0]["token"]})
        assert (await chat.recv())["type"] == "session"
        _, done = await turn_until_done(chat, "What is my lucky number?")
        assert done["usage"]["prompt_tokens"] > dropped["history_tokens"]  # the whole history, partial reply too
    assert len(session_detail(server.url, infos[0])["messages"]) == 6


async def test_one_turn_at_a_time_per_session_across_connections(server):
    async with WsChat.open(server.ws_url) as first, WsChat.open(server.ws_url) as second:
        info = await first.create(mode="full")
        await first.send({"type": "message", "content": STORY, "max_tokens": 300})
        assert (await first.recv())["type"] == "delta"

        await second.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
        assert (await second.recv())["type"] == "session"
        await second.send({"type": "message", "content": "Interrupting!", "max_tokens": 4})
        event = await second.recv()
        assert event["type"] == "error" and event["code"] == "session_busy"

        r = httpx.post(f"{server.url}/v1/chat/completions",
                       headers={"x-session-id": info["session_id"], "x-session-token": info["token"]},
                       # The history as it stands mid-turn (the reply is not in it yet): only busy can refuse it.
                       json={"model": MODEL, "max_tokens": 4, "messages": [
                           {"role": "user", "content": STORY}, {"role": "user", "content": "Interrupting over HTTP!"}]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"

        await first.send({"type": "cancel"})
        while (event := await first.recv())["type"] == "delta":
            pass
        assert event["type"] == "done" and event["finish_reason"] == "cancelled"
        _, done = await turn_until_done(second, "Now it is my turn.")

    messages = session_detail(server.url, info)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[::2]] == [STORY, "Now it is my turn."]  # never interleaved


async def test_a_client_leaving_an_sse_stream_cancels_the_turn(server):
    body = {"model": MODEL, "max_tokens": 300, "stream": True, "messages": [{"role": "user", "content": STORY}]}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            info = {"session_id": response.headers["x-session-id"], "token": response.headers["x-session-token"]}
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # the first text, then hang up
    done = await wait_idle(server, info)
    assert done["turn_stats"][-1]["finish_reason"] == "cancelled"
    assert done["turn_stats"][-1]["generated_tokens"] < 300
    assert done["messages"][-1]["cancelled"] is True
