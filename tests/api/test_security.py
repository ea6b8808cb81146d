"""API keys, session ownership, unguessable ids, no unsafe deserialisation, namespaced Redis keys."""
from __future__ import annotations

import ast
import asyncio
import json
import re
import uuid
from pathlib import Path

import httpx
import pytest
from serving_helpers import RedisServer, WsChat, local_server, turn_until_done
from websockets.exceptions import ConnectionClosed

from tiers.store.redis.keys import kv_key, owner_key, session_key

KEY_A, KEY_B = "alpha-" + uuid.uuid4().hex, "beta-" + uuid.uuid4().hex
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(loaded):
    with local_server(loaded, api_key=f"{KEY_A}, {KEY_B}", ws_auth_timeout_s=1.5) as srv:
        yield srv


def code_of(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


def test_http_needs_a_valid_bearer_key_except_health_and_page(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY_A}"},
                    {"Authorization": KEY_A}, {"Authorization": f"Bearer {KEY_A}x"}, {"Authorization": "Bearer"}):
        for method, path in [("GET", "/v1/sessions"), ("POST", "/v1/sessions"), ("GET", "/v1/models"),
                             ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                             ("GET", "/v1/sessions/s_anything"), ("DELETE", "/v1/sessions/s_anything"),
                             ("GET", "/v1/sessions/s_anything/memory-map")]:
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.text)
            assert code_of(r) == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
            assert r.headers["x-replica"] == "test-replica"
    assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
    assert httpx.get(f"{url}/").status_code == 200  # the page holds no data; it asks for the key
    assert httpx.get(f"{url}/v1/models", headers=A).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"bearer {KEY_B}"}).status_code == 200


async def test_a_session_answers_only_to_the_key_that_made_it(server):
    url = f"{server.url}/v1/sessions"
    info = httpx.post(url, headers=A, json={"mode": "full"}).json()
    sid, token = info["session_id"], {"x-session-token": info["token"]}
    async with WsChat.open(server.ws_url, headers=A) as chat:
        await chat.send({"type": "session.resume", "session_id": sid, "token": info["token"]})
        assert (await chat.recv())["type"] == "session"
        first, _ = await turn_until_done(chat, "My secret word is pineapple.")

    unknown = httpx.get(f"{url}/s_{uuid.uuid4().hex}", headers={**B, **token})
    for method, path in [("GET", f"/{sid}"), ("GET", f"/{sid}/export"), ("GET", f"/{sid}/memory-map"),
                         ("DELETE", f"/{sid}")]:
        r = httpx.request(method, url + path, headers={**B, **token})
        # Exactly what an id that does not exist gets: nothing tells B the session is there.
        assert r.status_code == unknown.status_code == 404 and code_of(r) == code_of(unknown) == "session_not_found"
    assert sid not in [s["session_id"] for s in httpx.get(url, headers=B).json()["sessions"]]
    assert sid in [s["session_id"] for s in httpx.get(url, headers=A).json()["sessions"]]

    r = httpx.post(f"{server.url}/v1/chat/completions", headers={**B, **token, "x-session-id": sid},
                   json={"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "My secret word is pineapple."},
                                      {"role": "assistant", "content": first},
                                      {"role": "user", "content": "What is my secret word?"}]})
    assert r.status_code == 404 and code_of(r) == "session_not_found"

    async with WsChat.open(server.ws_url, headers=B) as chat:
        await chat.send({"type": "session.resume", "session_id": sid, "token": info["token"]})
        assert await chat.recv() == {"type": "error", "code": "session_not_found", "message": "no session " + repr(sid)}

    detail = httpx.get(f"{url}/{sid}", headers={**A, **token}).json()
    assert [m["role"] for m in detail["messages"]] == ["user", "assistant"]  # B changed nothing
    assert httpx.delete(f"{url}/{sid}", headers={**A, **token}).status_code == 204


async def test_websocket_accepts_a_header_a_query_key_or_a_first_auth_frame(server):
    async with WsChat.open(server.ws_url, headers=A) as chat:
        assert (await chat.create())["session_id"]
    async with WsChat.open(f"{server.ws_url}?api_key={KEY_B}") as chat:
        assert (await chat.create())["session_id"]
    async with WsChat.open(server.ws_url) as chat:
        await chat.send({"type": "auth", "api_key": KEY_A})
        assert await chat.recv() == {"type": "authenticated"}
        info = await chat.create()
        _, done = await turn_until_done(chat, "Hello!")
        assert done["session_id"] == info["session_id"]


@pytest.mark.parametrize(
    "how",
    ["no key, a message first", "no key, invalid JSON first", "wrong auth frame", "wrong query key",
     "wrong header key", "silence"],
)
async def test_websocket_without_a_valid_key_is_refused_and_closed(server, how):
    url, headers, frame = server.ws_url, None, None
    if how == "no key, a message first":
        frame = json.dumps({"type": "session.create"})
    elif how == "no key, invalid JSON first":
        frame = "{nope"
    elif how == "wrong auth frame":
        frame = json.dumps({"type": "auth", "api_key": KEY_A + "x"})
    elif how == "wrong query key":
        url += "?api_key=nope"
    elif how == "wrong header key":
        headers = {"Authorization": "Bearer nope"}
    async with WsChat.open(url, headers=headers) as chat:
        if frame is not None:
            await chat.ws.send(frame)
        event = await chat.recv(timeout=10)
        assert event["type"] == "error" and event["code"] == "unauthorized", event
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(chat.ws.recv(), 10)
        assert chat.ws.close_code == 4401
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_session_ids_and_tokens_are_unguessable(server):
    made = [httpx.post(f"{server.url}/v1/sessions", headers=A, json={"mode": "full"}).json() for _ in range(16)]
    ids, tokens = [m["session_id"] for m in made], [m["token"] for m in made]
    assert len(set(ids)) == len(ids) and len(set(tokens)) == len(tokens)
    for sid, token in zip(ids, tokens):
        # token_urlsafe(18) and (24): 144 and 192 random bits, URL-safe alphabet.
        assert re.fullmatch(r"s_[A-Za-z0-9_-]{24}", sid) and re.fullmatch(r"[A-Za-z0-9_-]{32}", token)
    assert len({sid[2:6] for sid in ids}) > 12  # no shared prefix, no counter
    for m in made:
        assert httpx.delete(f"{server.url}/v1/sessions/{m['session_id']}",
                            headers={**A, "x-session-token": m["token"]}).status_code == 204


UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}


def test_no_pickle_or_eval_in_the_server_code():
    """Nothing a client or Redis sends is unpickled or evaluated: the serving code has no such call."""
    found = []
    for folder in ("api", "app", "tiers", "rocketkv_mt"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Import):
                    found += [where for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
                    found.append(where)
                elif isinstance(node, ast.Call):
                    f = node.func
                    if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                        found.append(where)
                    elif isinstance(f, ast.Attribute) and f.attr == "load" and getattr(f.value, "id", "") in (
                        "torch", "yaml", "np", "numpy"
                    ):
                        found.append(where)  # torch.load / yaml.load / np.load can run code from data
    assert found == []


async def test_every_redis_key_is_in_the_namespace(loaded, tmp_path):
    namespace = f"rkv-ns-{uuid.uuid4().hex[:6]}"
    with RedisServer(tmp_path) as redis_server:
        with local_server(loaded, redis_url=redis_server.url, redis_namespace=namespace, api_key=KEY_A) as srv:
            async with WsChat.open(srv.ws_url, headers=A) as chat:
                info = await chat.create(mode="tiered", budget=16)
                await turn_until_done(chat, "Tell me about the history of the printing press in Europe. " * 4)
                await turn_until_done(chat, "And in Asia?")
            for _ in range(50):  # the replica's totals are written by housekeeping, once a second
                if redis_server.client().hexists(f"{namespace}:replicas", "test-replica"):
                    break
                await asyncio.sleep(0.1)
            client, sid = redis_server.client(), info["session_id"]
            keys = {k.decode() for k in client.scan_iter(count=1000)}
            assert keys and all(k.startswith(namespace + ":") for k in keys), keys
            stored = client.hget(session_key(namespace, sid), "data")
            record = json.loads(stored)  # JSON, readable without any code from the server
            assert KEY_A not in stored.decode() and record["owner"].startswith("key-")
            # The record, its KV groups (the engine's KV went there too: pages and page tables), the
            # owner's listing index and its bytes, the replicas' totals: nothing else.
            kv = {k for k in keys if k.startswith(kv_key(namespace, sid, ""))}
            tables = {k for k in kv if k.startswith(kv_key(namespace, sid, "g"))}
            assert tables and all(client.hexists(k, "primary0") for k in tables)
            assert any(k.startswith(kv_key(namespace, sid, "p")) for k in kv)
            index = owner_key(namespace, record["owner"])
            assert keys == {session_key(namespace, sid), *kv, index, f"{index}:bytes", f"{namespace}:replicas"}
            # Ids that would address the session's other keys (or a pattern) are not ids at all.
            for bad in (f"{sid}:meta", f"{sid}:kv:{sorted(tables)[0].rpartition(':')[2]}", f"{sid}}}:kv:g0", "s_*"):
                r = httpx.get(f"{srv.url}/v1/sessions/{bad}", headers={**A, "x-session-token": info["token"]})
                assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text


def test_every_error_code_is_in_the_readme_table():
    """Clients rely on the codes: each one the server can send has a row in README's error table."""
    from api.errors import STATUS
    from api.routes import HTTP_CODES
    from app.contract.errors import ChatError

    def tree(cls):
        return {cls, *(c for sub in cls.__subclasses__() for c in tree(sub))}

    codes = {c for c in STATUS if c != "engine_error"} | set(HTTP_CODES.values())  # engine_error: a base class
    codes |= {cls.code for cls in tree(ChatError) if cls.code != "engine_error"}
    literal = re.compile(r"""(?:ApiError|send_error|error_event|TurnFailed)\(\s*["']([a-z_]+)["']""")
    for path in [*(ROOT / "api").glob("*.py"), *(ROOT / "app").rglob("*.py")]:
        codes |= set(literal.findall(path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Error codes"):]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M))
    assert {"session_diverged", "quota_exceeded"} <= codes  # the store's own refusals
    assert len(codes) >= 20 and codes <= documented, sorted(codes - documented)
