"""The bad-input catalogue: each case gets its documented error code, and nothing it does sticks.

WebSocket cases go to a session that has one finished turn; HTTP cases to the OpenAI and session
APIs. Afterwards that session holds exactly what it held before, the server is healthy, and a
new session chats normally.
"""
from __future__ import annotations

import json
import uuid

import httpx
import pytest
from serving_helpers import WsChat, local_server, session_detail, turn_until_done

KEY, OTHER_KEY = "k1-" + uuid.uuid4().hex, "k2-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": f"Bearer {OTHER_KEY}"}
MODEL = "SmolLM2-135M-Instruct"
MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES = 4096, 64 * 1024
MSG = {"type": "message", "content": "hi"}


@pytest.fixture(scope="module")
def server(loaded):
    with local_server(
        loaded, api_key=f"{KEY},{OTHER_KEY}", max_message_bytes=MAX_MESSAGE_BYTES,
        max_request_bytes=MAX_REQUEST_BYTES, max_tokens_limit=64, max_new_tokens=6,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
async def victim(server):
    """A session with one finished turn, and what it holds: bad input must leave it so."""
    async with WsChat.open(server.ws_url, headers=AUTH) as chat:
        info = await chat.create(mode="tiered", budget=32)
        await turn_until_done(chat, "Remember the number 7.")
    return info, detail(server, info)


@pytest.fixture(scope="module")
def foreign(server):
    """A session of the other key."""
    return httpx.post(f"{server.url}/v1/sessions", headers=OTHER, json={"mode": "full"}).json()


def detail(server, info) -> dict:
    d = session_detail(server.url, info, headers=AUTH)
    return {k: d[k] for k in ("messages", "turns", "history_tokens", "busy")}


def msg(**fields) -> str:
    return json.dumps({**MSG, **fields})


# (case id, frame: str (text) or bytes (binary), bound to the victim first?, expected code)
WS_CASES = [
    ("invalid JSON", "{not json", True, "invalid_json"),
    ("JSON array", "[1, 2]", True, "invalid_json"),
    ("JSON string", '"message"', True, "invalid_json"),
    ("empty frame", "", True, "invalid_json"),
    ("JSON nested too deeply", "[" * 20_000 + "]" * 20_000, True, "invalid_json"),
    ("binary garbage", b"\xff\xfe\x00\x01", True, "invalid_json"),
    ("binary invalid UTF-8 in JSON", b'{"type": "message", "content": "\xc3\x28"}', True, "invalid_json"),
    ("missing type", json.dumps({"content": "hi"}), True, "invalid_event"),
    ("type not a string", json.dumps({"type": 5}), True, "invalid_event"),
    ("unknown type", json.dumps({"type": "teleport"}), True, "unknown_type"),
    ("message without content", json.dumps({"type": "message"}), True, "invalid_event"),
    ("extra field", msg(colour="red"), True, "invalid_event"),
    ("content not a string", msg(content=5), True, "invalid_event"),
    ("content null", msg(content=None), True, "invalid_event"),
    ("max_tokens a string", msg(max_tokens="ten"), True, "invalid_event"),
    ("temperature NaN", '{"type": "message", "content": "hi", "temperature": NaN}', True, "invalid_event"),
    ("negative temperature", msg(temperature=-1), True, "invalid_sampling_params"),
    ("huge temperature", msg(temperature=1e308), True, "invalid_sampling_params"),
    ("top_p zero", msg(top_p=0), True, "invalid_sampling_params"),
    ("top_p above one", msg(top_p=1.5), True, "invalid_sampling_params"),
    ("max_tokens zero", msg(max_tokens=0), True, "invalid_sampling_params"),
    ("negative max_tokens", msg(max_tokens=-5), True, "invalid_sampling_params"),
    ("huge max_tokens", msg(max_tokens=10**30), True, "max_tokens_too_large"),
    ("negative seed", msg(seed=-1), True, "invalid_sampling_params"),
    ("seed over 64 bits", msg(seed=2**64, temperature=0.7), True, "invalid_sampling_params"),
    ("temperature that float32 makes 0", msg(temperature=1e-300), True, "invalid_sampling_params"),
    ("top_p that float32 makes 0", msg(top_p=1e-300, temperature=1), True, "invalid_sampling_params"),
    ("too many stop strings", msg(stop=["a"] * 9), True, "invalid_sampling_params"),
    ("top_k below -1", msg(top_k=-2), True, "invalid_sampling_params"),
    ("top_k a fraction", msg(top_k=2.5), True, "invalid_event"),
    ("min_p above one", msg(min_p=1.5), True, "invalid_sampling_params"),
    ("repetition_penalty zero", msg(repetition_penalty=0), True, "invalid_sampling_params"),
    ("frequency_penalty above two", msg(frequency_penalty=2.5), True, "invalid_sampling_params"),
    ("presence_penalty below minus two", msg(presence_penalty=-3), True, "invalid_sampling_params"),
    ("empty message", msg(content=""), True, "empty_message"),
    ("blank message", msg(content=" \n\t "), True, "empty_message"),
    ("oversized message", msg(content="é" * (MAX_MESSAGE_BYTES // 2 + 1)), True, "message_too_large"),
    ("frame over the request limit", msg(content="x" * (MAX_REQUEST_BYTES + 1)), True, "message_too_large"),
    ("lone surrogate", '{"type": "message", "content": "hi \\ud800"}', True, "invalid_event"),
    ("message before a session", msg(), False, "no_session"),
    ("unknown session id", json.dumps({"type": "session.resume", "session_id": "s_" + "A" * 24, "token": "x"}),
     False, "session_not_found"),
    ("session id with key syntax", json.dumps({"type": "session.resume", "session_id": "s_x:meta", "token": "x"}),
     False, "session_not_found"),
    ("session id a glob", json.dumps({"type": "session.resume", "session_id": "*", "token": "x"}),
     False, "session_not_found"),
    ("session id mistyped", json.dumps({"type": "session.resume", "session_id": 5}), False, "invalid_event"),
    ("token with a lone surrogate", '{"type": "session.resume", "session_id": "s_abc", "token": "\\udc00"}',
     False, "session_not_found"),
    ("unknown mode", json.dumps({"type": "session.create", "mode": "warp"}), False, "unknown_mode"),
    ("budget out of range", json.dumps({"type": "session.create", "budget": -5}), False, "unknown_mode"),
    ("oversized system prompt", json.dumps({"type": "session.create", "system": "s" * (MAX_MESSAGE_BYTES + 1)}),
     False, "message_too_large"),
]


@pytest.mark.parametrize("frame, bound, code", [c[1:] for c in WS_CASES], ids=[c[0] for c in WS_CASES])
async def test_websocket_bad_input(server, victim, frame, bound, code):
    info, _ = victim
    async with WsChat.open(server.ws_url, headers=AUTH) as chat:
        if bound:
            await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
            assert (await chat.recv())["type"] == "session"
        await chat.ws.send(frame)
        event = await chat.recv(timeout=60)
        assert event["type"] == "error" and event["code"] == code, event
        assert isinstance(event["message"], str) and event["message"]
        # The connection is still open and still serves.
        await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
        assert (await chat.recv())["type"] == "session"


async def test_websocket_foreign_and_wrong_token_resumes(server, victim, foreign):
    info, _ = victim
    async with WsChat.open(server.ws_url, headers=AUTH) as chat:
        for sid, token in [(foreign["session_id"], foreign["token"]), (info["session_id"], foreign["token"]),
                           (info["session_id"], None), (info["session_id"], "\udc00")]:
            await chat.send({"type": "session.resume", "session_id": sid, **({"token": token} if token else {})})
            event = await chat.recv()
            assert event["type"] == "error" and event["code"] == "session_not_found", (sid, event)


def _chat_body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


# (case id, method, path, headers, json body or raw bytes, status, code)
HTTP_CASES = [
    ("no key", "POST", "/v1/chat/completions", {}, _chat_body(), 401, "unauthorized"),
    ("wrong key", "GET", "/v1/sessions", {"Authorization": "Bearer nope"}, None, 401, "unauthorized"),
    ("not a bearer key", "GET", "/v1/models", {"Authorization": f"Token {KEY}"}, None, 401, "unauthorized"),
    ("invalid JSON", "POST", "/v1/chat/completions", AUTH, b"{nope", 400, "invalid_request"),
    ("invalid UTF-8 body", "POST", "/v1/chat/completions", AUTH,
     b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
     400, "invalid_request"),
    ("body is an array", "POST", "/v1/chat/completions", AUTH, [1, 2], 400, "invalid_request"),
    ("JSON nested too deeply", "POST", "/v1/sessions", AUTH, b"[" * 20_000 + b"]" * 20_000, 400, "invalid_request"),
    ("missing messages", "POST", "/v1/chat/completions", AUTH, {"model": MODEL}, 400, "invalid_request"),
    ("empty messages", "POST", "/v1/chat/completions", AUTH, _chat_body(messages=[]), 400, "invalid_request"),
    ("unknown role", "POST", "/v1/chat/completions", AUTH,
     _chat_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "invalid_request"),
    ("last message not user", "POST", "/v1/chat/completions", AUTH,
     _chat_body(messages=[{"role": "assistant", "content": "hi"}]), 400, "invalid_request"),
    ("text part not a string", "POST", "/v1/chat/completions", AUTH,
     _chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400, "invalid_request"),
    ("lone surrogate", "POST", "/v1/chat/completions", AUTH,
     b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "a\\ud800"}]}',
     400, "invalid_request"),
    ("temperature NaN", "POST", "/v1/chat/completions", AUTH,
     b'{"model": "SmolLM2-135M-Instruct", "temperature": NaN, "messages": [{"role": "user", "content": "a"}]}',
     400, "invalid_request"),
    ("negative temperature", "POST", "/v1/chat/completions", AUTH, _chat_body(temperature=-1), 400,
     "invalid_sampling_params"),
    ("negative max_tokens", "POST", "/v1/chat/completions", AUTH, _chat_body(max_tokens=-1), 400,
     "invalid_sampling_params"),
    ("tiny temperature", "POST", "/v1/chat/completions", AUTH, _chat_body(temperature=1e-300), 400,
     "invalid_sampling_params"),
    ("seed over 64 bits", "POST", "/v1/chat/completions", AUTH, _chat_body(seed=2**64, temperature=1), 400,
     "invalid_sampling_params"),
    ("huge max_tokens", "POST", "/v1/chat/completions", AUTH, _chat_body(max_tokens=10**30), 400,
     "max_tokens_too_large"),
    ("frequency_penalty out of range", "POST", "/v1/chat/completions", AUTH, _chat_body(frequency_penalty=3), 400,
     "invalid_sampling_params"),
    ("min_p negative", "POST", "/v1/chat/completions", AUTH, _chat_body(min_p=-0.5), 400,
     "invalid_sampling_params"),
    ("repetition_penalty huge", "POST", "/v1/chat/completions", AUTH, _chat_body(repetition_penalty=1e9), 400,
     "invalid_sampling_params"),
    ("n above one", "POST", "/v1/chat/completions", AUTH, _chat_body(n=3), 400, "invalid_request"),
    ("unknown model", "POST", "/v1/chat/completions", AUTH, _chat_body(model="gpt-4"), 404, "model_not_found"),
    ("empty message", "POST", "/v1/chat/completions", AUTH,
     _chat_body(messages=[{"role": "user", "content": ""}]), 400, "empty_message"),
    ("oversized message", "POST", "/v1/chat/completions", AUTH,
     _chat_body(messages=[{"role": "user", "content": "x" * (MAX_MESSAGE_BYTES + 1)}]), 400, "message_too_large"),
    ("body over the request limit", "POST", "/v1/sessions/import", AUTH,
     {"messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}, 413, "request_too_large"),
    ("unknown x-session-id", "POST", "/v1/chat/completions", {**AUTH, "x-session-id": "s_nope", "x-session-token": "t"},
     _chat_body(), 404, "session_not_found"),
    ("x-session-id with key syntax", "POST", "/v1/chat/completions",
     {**AUTH, "x-session-id": "s_a:meta", "x-session-token": "t"}, _chat_body(), 404, "session_not_found"),
    ("unknown session", "GET", "/v1/sessions/s_" + "B" * 24, {**AUTH, "x-session-token": "t"}, None, 404,
     "session_not_found"),
    ("session path with key syntax", "GET", "/v1/sessions/s_x:kv:primary-l0/export", {**AUTH, "x-session-token": "t"},
     None, 404, "session_not_found"),
    ("unknown mode", "POST", "/v1/sessions", AUTH, {"mode": "warp"}, 400, "unknown_mode"),
    ("budget not a number", "POST", "/v1/sessions", AUTH, {"budget": "lots"}, 400, "invalid_request"),
    ("extra field", "POST", "/v1/sessions", AUTH, {"colour": "red"}, 400, "invalid_request"),
    ("negative token ids", "POST", "/v1/sessions/import", AUTH,
     {"messages": [{"role": "user", "content": "x"}], "token_ids": [-1]}, 400, "invalid_request"),
    ("import with a lone surrogate", "POST", "/v1/sessions/import", AUTH,
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "invalid_request"),
    ("no such route", "GET", "/v1/nothing-here", AUTH, None, 404, "not_found"),
    ("wrong method", "PUT", "/v1/models", AUTH, None, 405, "method_not_allowed"),
]


@pytest.mark.parametrize("method, path, headers, body, status, code", [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(server, method, path, headers, body, status, code):
    kwargs = {"content": body, "headers": {**headers, "content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body, "headers": headers}
    r = httpx.request(method, server.url + path, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"], error


def test_http_foreign_session_and_wrong_token(server, victim, foreign):
    info, _ = victim
    url = f"{server.url}/v1/sessions"
    for sid, token in [(foreign["session_id"], foreign["token"]), (info["session_id"], "wrong")]:
        for method, path in [("GET", f"/{sid}"), ("GET", f"/{sid}/export"), ("DELETE", f"/{sid}")]:
            r = httpx.request(method, url + path, headers={**AUTH, "x-session-token": token})
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


async def test_afterwards_the_server_is_healthy_and_sessions_are_intact(server, victim):
    info, before = victim
    assert detail(server, info) == before  # no bad input left a trace in the session
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
    async with WsChat.open(server.ws_url, headers=AUTH) as chat:
        await chat.send({"type": "session.resume", "session_id": info["session_id"], "token": info["token"]})
        assert (await chat.recv())["type"] == "session"
        _, done = await turn_until_done(chat, "What number did I mention?")
        assert done["usage"]["prompt_tokens"] > before["history_tokens"]  # the earlier turn is still there
        fresh = await chat.create()
        _, done = await turn_until_done(chat, "Hello!")
        assert done["session_id"] == fresh["session_id"]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=_chat_body())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
