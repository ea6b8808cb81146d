"""Configurable limits, each enforced with its structured error: message bytes, history tokens,
generated tokens per turn, frames per second, request bytes, and sessions per replica (with idle
sessions that Redis keeps making room, their host-tier slots given back but their Redis copies kept).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from serving_helpers import WsChat, local_server, session_detail, turn_until_done

from tiers.store.redis.keys import kv_key

MODEL = "SmolLM2-135M-Instruct"
LONG = "The lighthouse keeper wrote in his log about the storm, the ships, and the gulls. " * 3


@pytest.fixture(scope="module")
def limited(loaded):
    with local_server(loaded, max_message_bytes=2000, max_context=256, max_tokens_limit=16, max_new_tokens=6,
                      ws_frames_per_s=4, ws_frame_burst=4, max_request_bytes=32 * 1024) as srv:
        yield srv


async def expect_error(chat: WsChat, code: str, **message) -> None:
    await chat.send({"type": "message", "max_tokens": 4, **message})
    event = await chat.recv()
    assert event["type"] == "error" and event["code"] == code, event


async def test_history_beyond_the_context_is_refused_and_the_session_stays_usable(limited):
    async with WsChat.open(limited.ws_url) as chat:
        info = await chat.create(mode="full")
        _, first = await turn_until_done(chat, "Hello there, how are you?")
        before = session_detail(limited.url, info)
        await expect_error(chat, "context_length_exceeded", content=LONG * 4)  # ~220 tokens + history > 256
        after = session_detail(limited.url, info)
        assert (after["messages"], after["history_tokens"], after["turns"]) == (
            before["messages"], before["history_tokens"], before["turns"])
        _, done = await turn_until_done(chat, "Fine, a short one then.")
        assert done["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + first["usage"]["generated_tokens"]
        assert done["usage"]["prefilled_tokens"] < done["usage"]["prompt_tokens"] // 2  # its cache survived too


async def test_message_bytes_and_generated_tokens_per_turn(limited):
    async with WsChat.open(limited.ws_url) as chat:
        await chat.create(mode="full")
        await expect_error(chat, "message_too_large", content="é" * 1001)  # 2002 bytes
        await expect_error(chat, "max_tokens_too_large", content="Hi", max_tokens=17)
        _, done = await turn_until_done(chat, "Count from one to fifty.", max_tokens=16)
        assert done["usage"]["generated_tokens"] <= 16
        await chat.send({"type": "message", "content": "And again, to fifty."})  # no max_tokens: the default
        while (event := await chat.recv())["type"] == "delta":
            pass
        assert event["type"] == "done" and event["usage"]["generated_tokens"] <= 6


async def test_frames_over_the_rate_are_dropped_with_rate_limited_and_the_connection_stays(limited):
    async with WsChat.open(limited.ws_url) as chat:
        for _ in range(12):  # an idle 'cancel' that passes is answered no_active_turn; the rest are refused
            await chat.send({"type": "cancel"})
        answers = []
        with pytest.raises(asyncio.TimeoutError):
            while True:
                answers.append(await chat.recv(timeout=1.0))
        assert len(answers) == 12 and {e["code"] for e in answers} == {"rate_limited", "no_active_turn"}
        refused = [e for e in answers if e["code"] == "rate_limited"]
        assert 12 - 4 - 3 <= len(refused) <= 12 - 4  # the burst passes; a little refills meanwhile
        await asyncio.sleep(1.0)
        info = await chat.create(mode="full")  # still open, and served again once under the rate
        assert info["session_id"]


def test_request_bodies_over_the_limit_are_refused_before_reading(limited):
    big = {"messages": [{"role": "user", "content": "x" * 40_000}]}
    r = httpx.post(f"{limited.url}/v1/sessions/import", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: counted as it arrives
        body = json.dumps(big).encode()
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    r = httpx.post(f"{limited.url}/v1/sessions/import", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{limited.url}/v1/sessions/import", json={"messages": [{"role": "user", "content": "x" * 1000}]})
    assert r.status_code == 201, r.text
    assert httpx.get(f"{limited.url}/healthz").status_code == 200


async def test_sessions_per_replica(loaded):
    with local_server(loaded, max_sessions_per_replica=3) as srv:
        url = f"{srv.url}/v1/sessions"
        made = [httpx.post(url, json={"mode": "full"}).json() for _ in range(3)]
        r = httpx.post(url, json={"mode": "full"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
        r = httpx.post(f"{srv.url}/v1/chat/completions",
                       json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
        async with WsChat.open(srv.ws_url) as chat:
            await chat.send({"type": "session.create"})
            event = await chat.recv()
            assert event["type"] == "error" and event["code"] == "too_many_sessions"
            # The sessions already held keep working at the limit.
            await chat.send({"type": "session.resume", "session_id": made[0]["session_id"], "token": made[0]["token"]})
            assert (await chat.recv())["type"] == "session"
            await turn_until_done(chat, "Still fine?")
        gone = made[1]
        assert httpx.delete(f"{url}/{gone['session_id']}", headers={"x-session-token": gone["token"]}).status_code == 204
        assert httpx.post(url, json={"mode": "full"}).status_code == 201


async def _tiered_session_with_cold_kv(server) -> dict:
    async with WsChat.open(server.ws_url) as chat:
        info = await chat.create(mode="tiered", budget=16)
        await turn_until_done(chat, LONG)
    host = server.service.engine.host_tier
    assert host.session_bytes(info["session_id"]) > 0, "the test needs cold KV in the host tier"
    return info


async def _resumes_with_its_kv(server, info) -> None:
    async with WsChat.open(server.ws_url) as chat:
        await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
        event = await chat.recv()
        assert event["type"] == "session" and event["restored"], event
        # The cold pages came back from Redis: had leaving memory deleted them, this turn would fail.
        _, done = await turn_until_done(chat, "What did the keeper write about?")
        assert done["usage"]["prefilled_tokens"] < done["usage"]["prompt_tokens"] // 2


async def _queued_jobs_ran(server) -> None:
    """Wait for the model thread's queued jobs: a session leaving memory gives its host slots back in
    one, after the jobs already queued for its cache."""
    await asyncio.wait_for(asyncio.wrap_future(server.service.engine.batcher.submit(lambda: None)), 15)


def _redis_items(redis_url: str, namespace: str, sid: str) -> int:
    """The KV items (pages, page tables, primary sets) Redis holds of a session, over all of its groups."""
    import redis

    client = redis.Redis.from_url(redis_url)
    return sum(client.hlen(key) for key in client.scan_iter(match=kv_key(namespace, sid, "*")))


async def test_a_full_replica_makes_room_by_dropping_idle_stored_sessions(loaded, redis_url):
    namespace = f"rkv-test-{uuid.uuid4().hex[:8]}"
    with local_server(loaded, max_sessions_per_replica=2, redis_url=redis_url, redis_namespace=namespace) as srv:
        first = await _tiered_session_with_cold_kv(srv)
        await _tiered_session_with_cold_kv(srv)
        items = _redis_items(redis_url, namespace, first["session_id"])
        host = srv.service.engine.host_tier
        held_bytes = host.stats.bytes
        r = httpx.post(f"{srv.url}/v1/sessions", json={"mode": "full"})
        assert r.status_code == 201, r.text  # the least recently used idle session made room
        assert first["session_id"] not in srv.service.engine.sessions
        await _queued_jobs_ran(srv)
        assert host.session_bytes(first["session_id"]) == 0 and host.stats.bytes < held_bytes  # slots given back
        assert _redis_items(redis_url, namespace, first["session_id"]) == items > 0  # Redis copies kept
        await _resumes_with_its_kv(srv, first)
        assert len(srv.service.engine.sessions) <= 2


async def test_idle_sessions_leave_memory_and_give_back_their_host_slots(loaded, redis_url):
    namespace = f"rkv-test-{uuid.uuid4().hex[:8]}"
    with local_server(loaded, idle_evict_s=1, redis_url=redis_url, redis_namespace=namespace) as srv:
        info = await _tiered_session_with_cold_kv(srv)
        host = srv.service.engine.host_tier
        deadline = time.monotonic() + 15
        while info["session_id"] in srv.service.engine.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert info["session_id"] not in srv.service.engine.sessions
        await _queued_jobs_ran(srv)
        assert host.session_bytes(info["session_id"]) == 0 and host.stats.bytes == 0
        await _resumes_with_its_kv(srv, info)
