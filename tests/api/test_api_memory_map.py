"""``GET /v1/sessions/{id}/memory-map`` and the ``done`` event's map summary, on a ``tiered`` session whose
host tier spills to Redis (all three tiers in use), checked against the cache's own state; and the
same refusal as every session route for a wrong token or another API key's session."""
from __future__ import annotations

import argparse
import uuid

import httpx
import pytest
import torch
from serving_helpers import WsChat, local_server, turn_until_done
from websockets.asyncio.client import connect

from api.client import Client, auth_headers, ws_url
from api.map_text import render, tier_line
from bench.haystack import hide

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "alpha-" + uuid.uuid4().hex, "beta-" + uuid.uuid4().hex
PAGE_BYTES = 32 * 64 * 2 * 4  # one cold page of the bundled model: 32 tokens of one KV head, keys and values, fp32
FIRST = hide(["The locker code is 5521."], 320, [0.3], seed=2) + "\n\nWhat is the locker code?"
STATE_OF_TIER = {"host": "host", "redis": "redis"}


def decode_runs(runs: list[int], states: list[str]) -> list[str]:
    out: list[str] = []
    for state, length in zip(runs[::2], runs[1::2]):
        out += [states[state]] * length
    return out


def decode_ranges(flat: list[int]) -> set[int]:
    return {p for start, length in zip(flat[::2], flat[1::2]) for p in range(start, start + length)}


def expected_rows(service, sid: str) -> dict[tuple[int, int], list[str]]:
    """Each (layer, KV head)'s state per position, read straight from the cache, its cold pages and the host tier."""
    session = service.engine.sessions[sid]
    cache, host = session.cache, service.engine.host_tier
    n = len(session.token_ids)
    rows = {}
    for layer, store in enumerate(cache.layers):
        cold = cache.prefill.cold[layer]
        for head in range(cache.spec.num_kv_heads):
            row = ["unfed"] * n
            for p in range(cache.history_len):
                row[p] = "evicted"
            for page, where in enumerate(host.where_many(sid, list(cold.ids[head]))):
                for p in cold._pos.buf[head, page][cold._alive.buf[head, page]].tolist():
                    row[p] = STATE_OF_TIER.get(where, "lost")
            for p in store.positions[head].tolist():
                row[p] = "device"
            rows[(layer, head)] = row
    return rows


@pytest.fixture(scope="module")
def server(loaded, redis_url):
    # 120 host pages for several hundred cold pages: most of the cold history spills to Redis.
    with local_server(loaded, api_key=f"{KEY_A}, {KEY_B}", redis_url=redis_url,
                      redis_namespace=f"rkvtest-map-{uuid.uuid4().hex[:6]}", host_tier_bytes=120 * PAGE_BYTES,
                      page_tokens=32) as srv:
        yield srv


async def test_the_map_of_a_tiered_session_in_all_three_tiers(server):
    a = {"Authorization": f"Bearer {KEY_A}"}
    info = httpx.post(f"{server.url}/v1/sessions", headers=a, json={"mode": "tiered", "budget": 64}).json()
    sid, token = info["session_id"], {"x-session-token": info["token"]}
    async with WsChat.open(server.ws_url, headers=a) as chat:
        await chat.send({"type": "session.resume", "session_id": sid, "token": info["token"]})
        assert (await chat.recv())["type"] == "session"
        await turn_until_done(chat, FIRST, max_tokens=6)
        _, done = await turn_until_done(chat, "Say the locker code once more.", max_tokens=6)

    r = httpx.get(f"{server.url}/v1/sessions/{sid}/memory-map", headers={**a, **token}, params={"text": "true"})
    assert r.status_code == 200, r.text
    mm = r.json()
    session = server.service.engine.sessions[sid]
    cache = session.cache
    n = len(session.token_ids)
    assert mm["encoding"] == "rle/1" and mm["held"] and mm["mode"] == "tiered" and mm["fed"] == cache.history_len
    assert len(mm["rows"]) == cache.spec.num_layers * cache.spec.num_kv_heads
    expected = expected_rows(server.service, sid)
    for row in mm["rows"]:
        states = decode_runs(row["runs"], mm["states"])
        assert states == expected[(row["layer"], row["head"])], (row["layer"], row["head"])
        assert all(states[p] == "device" for p in decode_ranges(row["readmitted"]))
        assert all(states[p] in ("host", "redis") for p in decode_ranges(row["demoted"]))
    summary = mm["summary"]
    assert summary["positions"] == n and summary["device"] > 0 and summary["host"] > 0 and summary["redis"] > 0
    assert summary["readmitted"] == cache.readmitted == sum(len(decode_ranges(r["readmitted"])) for r in mm["rows"])
    assert summary["demoted"] > 0
    # The done event carried the same summary (nothing moved since the turn ended).
    assert done["memory_map"] == summary

    # Message spans cover the conversation in order; hovering one shows its text.
    spans = mm["messages"]
    assert [s["role"] for s in spans] == ["user", "assistant", "user", "assistant"]
    assert all(s["end"] <= t["start"] for s, t in zip(spans, spans[1:]))
    assert len(mm["tokens"]) == n
    assert "locker code" in "".join(mm["tokens"][spans[0]["start"] : spans[0]["end"]])
    assert "once more" in "".join(mm["tokens"][spans[2]["start"] : spans[2]["end"]])

    # Without ?text the tokens are left out; the map is the same.
    plain = httpx.get(f"{server.url}/v1/sessions/{sid}/memory-map", headers={**a, **token}).json()
    assert plain["tokens"] is None and plain["rows"] == mm["rows"]


async def test_the_map_answers_only_its_owner_with_its_token(server):
    a, b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
    info = httpx.post(f"{server.url}/v1/sessions", headers=a, json={"mode": "snapkv", "budget": 32}).json()
    url = f"{server.url}/v1/sessions/{info['session_id']}/memory-map"
    token = {"x-session-token": info["token"]}
    unknown = httpx.get(f"{server.url}/v1/sessions/s_{uuid.uuid4().hex}/memory-map", headers={**a, **token})
    for headers in ({**b, **token}, {**a, "x-session-token": "wrong"}, a):
        r = httpx.get(url, headers=headers)
        assert r.status_code == unknown.status_code == 404, r.text
        assert r.json()["error"]["code"] == unknown.json()["error"]["code"] == "session_not_found"
    assert httpx.get(url, headers=token).status_code == 401  # no API key at all
    # A session with no turn yet: nothing fed, every position of its (empty) conversation unfed.
    fresh = httpx.get(url, headers={**a, **token}).json()
    assert fresh["summary"]["positions"] == 0 and fresh["rows"][0]["runs"] == [] and fresh["messages"] == []
    assert torch.tensor([r["layer"] for r in fresh["rows"]]).unique().numel() == 30


def test_the_text_map_draws_layers_messages_and_readmissions():
    states = ["device", "host", "redis", "evicted", "unfed", "lost"]
    # Two layers, one KV head, 8 positions: layer 0 device, host, Redis, layer 1 device with two re-admitted.
    mm = {"states": states, "summary": {"positions": 8, "layers": 2, "kv_heads": 1},
          "rows": [{"layer": 0, "head": 0, "runs": [0, 2, 1, 2, 2, 4], "readmitted": [], "demoted": []},
                   {"layer": 1, "head": 0, "runs": [0, 8], "readmitted": [4, 2], "demoted": []}],
          "messages": [{"role": "user", "start": 0, "end": 5}, {"role": "assistant", "start": 5, "end": 8}]}
    lines = render(mm, width=8).splitlines()
    assert lines[1].endswith("U    A  ")
    assert lines[2].endswith("|##++....|") and lines[3].endswith("|####**##|")
    halved = render(mm, width=4).splitlines()  # two positions a column: the state most of them are in
    assert halved[2].endswith("|#+..|") and halved[3].endswith("|##*#|") and "2 tokens a column" in halved[0]
    done = {"memory": {"device_bytes": 3 * 2**20, "host_bytes": 1536, "redis_bytes": 0, "readmitted_tokens": 7},
            "memory_map": {"layers": 2, "kv_heads": 1, "demoted": 10}}
    assert tier_line(done) == "  tiers: device 3.0 MiB | host 1.5 KiB | Redis 0 B; 7 tokens re-admitted, 5 demoted"


async def test_the_terminal_client_prints_tiers_after_a_reply_and_draws_the_map(server, monkeypatch, capsys):
    monkeypatch.setenv("RKV_API_KEY", KEY_A)
    args = argparse.Namespace(url=server.url, mode="tiered", budget=32, max_tokens=4, temperature=None, top_p=None)
    async with connect(ws_url(server.url), additional_headers=auth_headers()) as ws:
        client = Client(ws, args)
        await client.bind(client._create())
        await client.turn("Tell me about the moon and the tides in a few words, please, and why they happen.")
        assert await client.command("/map")
    err = capsys.readouterr().err
    tiers = [line for line in err.splitlines() if line.startswith("  tiers: device ")]
    assert len(tiers) == 1 and "tokens re-admitted" in tiers[0]
    drawn = [line for line in err.splitlines() if line.lstrip().startswith("layer ")]
    assert len(drawn) == 30 and all(set(line.split("|")[1]) <= set("#+.*x_!") for line in drawn)
    assert "memory map:" in err and "U" in err
