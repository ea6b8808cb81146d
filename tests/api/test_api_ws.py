"""WebSocket chat API against a real server on loopback (in-process engine, no Ray)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serving_helpers import WsChat, cli_server, local_server, session_detail


@pytest.fixture(scope="module")
def server(loaded):
    with local_server(loaded) as srv:
        yield srv


async def test_two_turns_stream_and_prefill_only_the_new_message(server):
    async with WsChat.open(server.ws_url) as chat:
        info = await chat.create(system="You are a helpful assistant.")
        assert info["session_id"] and info["token"] and info["mode"] == "tiered" and info["replica"] == "test-replica"

        deltas1, done1 = await chat.turn("My name is Ada. Please remember it.")
        deltas2, done2 = await chat.turn("What is my name?")

    for deltas, done in ((deltas1, done1), (deltas2, done2)):
        assert done["type"] == "done", done
        assert deltas and all(isinstance(d, str) for d in deltas)
        assert done["usage"]["generated_tokens"] >= 1
        assert done["replica"] == "test-replica"
        assert set(done["memory"]) >= {"device_bytes", "host_bytes", "redis_bytes", "readmitted_tokens"}
        assert done["memory"]["device_bytes"] > 0

    u1, u2 = done1["usage"], done2["usage"]
    assert u1["prefilled_tokens"] == u1["prompt_tokens"]  # nothing cached before the first turn
    assert u2["prompt_tokens"] > u1["prompt_tokens"] + u1["generated_tokens"]
    assert u2["prefilled_tokens"] < u2["prompt_tokens"] // 2  # the history came from the cache

    engine_turns = session_detail(server.url, info)["turn_stats"]
    assert [t["prefilled_tokens"] for t in engine_turns] == [u1["prefilled_tokens"], u2["prefilled_tokens"]]
    assert [t["prompt_tokens"] for t in engine_turns] == [u1["prompt_tokens"], u2["prompt_tokens"]]


async def test_bad_events_get_error_events_and_the_connection_stays_open(server):
    async with WsChat.open(server.ws_url) as chat:
        cases = [
            ("{not json", "invalid_json"),
            ("[1, 2]", "invalid_json"),
            (json.dumps({"content": "no type"}), "invalid_event"),
            (json.dumps({"type": "teleport"}), "unknown_type"),
            (json.dumps({"type": "message", "content": "hi"}), "no_session"),
            (json.dumps({"type": "session.create", "budget": "big"}), "invalid_event"),
            (json.dumps({"type": "session.resume"}), "invalid_event"),
            (json.dumps({"type": "session.create", "mode": "nope"}), "unknown_mode"),
        ]
        for frame, code in cases:
            await chat.ws.send(frame)
            event = await chat.recv()
            assert event["type"] == "error" and event["code"] == code, (frame, event)
            assert event["message"]

        await chat.create()
        for fields, code in [
            ({"content": "   "}, "empty_message"),
            ({"content": "hi", "temperature": -1}, "invalid_sampling_params"),
            ({"content": "hi", "top_p": 0}, "invalid_sampling_params"),
            ({"content": 5}, "invalid_event"),
            ({"content": "hi", "colour": "red"}, "invalid_event"),
        ]:
            await chat.send({"type": "message", **fields})
            event = await chat.recv()
            assert event == {"type": "error", "code": code, "message": event["message"]}, fields

        _, done = await chat.turn("Still there?")
        assert done["type"] == "done"


async def test_resume_needs_the_token_and_keeps_the_cache(server):
    async with WsChat.open(server.ws_url) as chat:
        info = await chat.create()
        _, first = await chat.turn("Tell me a color.")
    async with WsChat.open(server.ws_url) as chat:
        for sid, token in [(info["session_id"], "wrong"), (info["session_id"], None), ("s_unknown", info["token"])]:
            await chat.send({"type": "session.resume", "session_id": sid, **({"token": token} if token else {})})
            event = await chat.recv()
            assert event["type"] == "error" and event["code"] == "session_not_found"
        await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
        resumed = await chat.recv()
        assert resumed["type"] == "session" and resumed["session_id"] == info["session_id"]
        _, second = await chat.turn("Another one.")
    assert second["usage"]["prefilled_tokens"] < second["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]


async def test_cancel_and_busy(server):
    async with WsChat.open(server.ws_url) as chat:
        await chat.create()
        await chat.send({"type": "message", "content": "Write a long story about the sea.", "max_tokens": 400})
        await chat.send({"type": "message", "content": "and another"})
        events = []
        while not events or events[-1]["type"] != "done":
            events.append(await chat.recv())
            if len(events) == 3:
                await chat.send({"type": "cancel"})
        errors = [e for e in events if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["session_busy"]
        done = events[-1]
        assert done["type"] == "done" and done["finish_reason"] == "cancelled"
        assert done["usage"]["generated_tokens"] < 400

        await chat.send({"type": "cancel"})  # idle: nothing to cancel, and the answer says so
        event = await chat.recv()
        assert event["type"] == "error" and event["code"] == "no_active_turn" and event["message"]
        _, after = await chat.turn("Short answer please.")
        assert after["type"] == "done" and after["finish_reason"] in ("stop", "length")


async def test_every_client_event_gets_an_answer(server):
    """Even a cancel before any session, or after its turn is over, is answered (never silence)."""
    async with WsChat.open(server.ws_url) as chat:
        await chat.send({"type": "cancel"})
        event = await chat.recv()
        assert event["type"] == "error" and event["code"] == "no_active_turn"
        await chat.create(mode="full")
        _, done = await chat.turn("Say hi.", max_tokens=2)
        assert done["type"] == "done"
        await chat.send({"type": "cancel"})
        event = await chat.recv()
        assert event["type"] == "error" and event["code"] == "no_active_turn"


async def test_closing_the_socket_mid_turn_cancels_it(server):
    async with WsChat.open(server.ws_url) as chat:
        info = await chat.create()
        await chat.send({"type": "message", "content": "Count to one hundred.", "max_tokens": 400})
        assert (await chat.recv())["type"] == "delta"
    for _ in range(100):
        detail = session_detail(server.url, info)
        if not detail["busy"]:
            break
        await asyncio.sleep(0.1)
    assert not detail["busy"]
    assert detail["turn_stats"][-1]["finish_reason"] == "cancelled"


@pytest.mark.slow
async def test_cli_serve_without_ray():
    with cli_server("--no-ray") as url:
        assert httpx.get(f"{url}/healthz").json()["backend"] == "local"
        async with WsChat.open(url.replace("http", "ws") + "/v1/chat/ws") as chat:
            await chat.create()
            deltas, done = await chat.turn("Hello!")
        assert deltas and done["type"] == "done"


async def test_sampling_values_reach_the_turn_and_the_rest_are_the_servers_defaults(server):
    """The session event says what a silent turn gets; a message's own values replace those it sends,
    on the WebSocket and the OpenAI path alike, and ``done`` says what the reply was drawn with."""
    async with WsChat.open(server.ws_url) as chat:
        info = await chat.create()
        defaults = info["sampling"]
        # The suite's servers are greedy (tests/conftest.py); the rest are the chat defaults.
        assert defaults["temperature"] == 0 and defaults["repetition_penalty"] == 1.0
        assert defaults["top_k"] == 20 and defaults["top_p"] == 0.8
        sent = {"temperature": 0.7, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "frequency_penalty": 0.4,
                "presence_penalty": -0.2, "seed": 11}
        _, done = await chat.turn("Name a fruit.", **sent)
        assert done["type"] == "done", done
        assert done["sampling"] == {**defaults, **sent}
        _, silent = await chat.turn("And a colour?")
        assert silent["sampling"] == {**defaults, "seed": None}

    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "top_k": 3, "min_p": 0.2, "repetition_penalty": 1.1, "frequency_penalty": 1.0, "presence_penalty": 0.5,
            "temperature": 0.9, "seed": 1}
    async with httpx.AsyncClient(timeout=60) as http:
        first = await http.post(f"{server.url}/v1/chat/completions", json=body)
        again = await http.post(f"{server.url}/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    # Seeded: the same request draws the same reply (the penalties and filters ran, deterministically).
    assert first.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]
