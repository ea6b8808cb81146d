"""Ray Serve with two CPU replicas: session affinity, then failover of a killed replica via Redis."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from serving_helpers import WsChat, deploy_on_a_free_port, free_port

SESSIONS, TURNS = 8, 3


class FakeReplica:
    def __init__(self, unique_id: str, held: set[str] = frozenset()):
        self.replica_id = SimpleNamespace(unique_id=unique_id)
        self.multiplexed_model_ids = set(held)


def test_router_prefers_the_holder_then_a_stable_hash():
    from api.ray_router import pick_replica

    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    sessions = [f"s_{i}" for i in range(200)]
    first = {s: pick_replica(s, [a, b, c]).replica_id.unique_id for s in sessions}
    assert set(Counter(first.values())) == {"a", "b", "c"}
    assert first == {s: pick_replica(s, [c, a, b]).replica_id.unique_id for s in sessions}  # order-free
    # Losing a replica moves only its own sessions.
    after = {s: pick_replica(s, [a, c]).replica_id.unique_id for s in sessions}
    assert all(after[s] == first[s] for s in sessions if first[s] != "b")
    # A replica that reports holding the session wins over the hash.
    s = next(s for s in sessions if first[s] == "a")
    assert pick_replica(s, [a, b, FakeReplica("c", {s})]).replica_id.unique_id == "c"


@pytest.fixture(scope="module")
def cluster(redis_url):
    ray = pytest.importorskip("ray")
    from ray import serve

    from api.deployment import deploy
    from app.settings import ServerSettings

    settings = ServerSettings(
        host="127.0.0.1",
        port=free_port(),
        num_replicas=2,
        replica_num_cpus=1,
        ray_num_cpus=2,
        ray_object_store_bytes=100 * 1024**2,
        threads=1,
        max_new_tokens=6,
        redis_url=redis_url,
        redis_namespace=f"rkv-test-{uuid.uuid4().hex[:8]}",
        request_retry_s=90,
    )
    try:
        settings = deploy_on_a_free_port(settings, deploy, serve)
        yield settings
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        import redis

        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(match=f"{settings.redis_namespace}:*"):
            r.delete(key)


def kill_replica(replica: str) -> None:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].endswith(f"ChatReplica#{replica}")]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0], namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
    # SIGKILL first: ray.kill alone returns before the process stops, and a loaded machine can let
    # the doomed replica start (and then drop) the next turns, which is not what this test is about.
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    ray.kill(actor, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.__ray_ready__.remote(), timeout=60)


@pytest.mark.slow
async def test_sessions_stick_to_a_replica_and_survive_its_death(cluster):
    url = f"http://127.0.0.1:{cluster.port}"
    async with contextlib.AsyncExitStack() as stack:
        chats = [await stack.enter_async_context(WsChat.open(f"ws://127.0.0.1:{cluster.port}/v1/chat/ws"))
                 for _ in range(SESSIONS)]
        infos = [await chat.create() for chat in chats]

        async def converse(chat: WsChat, i: int, turns: range) -> list[dict]:
            dones = []
            for k in turns:
                # Sent once: a call that reached the killed replica is retried by the ingress under the
                # turn's idempotency key, so it lands on a survivor and runs there once.
                _, done = await chat.turn(f"Session {i}, message {k}: tell me something.", max_tokens=6)
                assert done["type"] == "done", done
                dones.append(done)
            return dones

        runs = await asyncio.gather(*(converse(c, i, range(TURNS)) for i, c in enumerate(chats)))
        for info, dones in zip(infos, runs):
            assert {d["replica"] for d in dones} == {info["replica"]}, "a session moved between replicas"
            assert [d["usage"]["prefilled_tokens"] < d["usage"]["prompt_tokens"] for d in dones[1:]] == [True] * 2

        load = Counter(info["replica"] for info in infos)
        victim = load.most_common(1)[0][0]
        kill_replica(victim)

        more = await asyncio.gather(*(converse(c, i, range(TURNS, TURNS + 1)) for i, c in enumerate(chats)))
        for info, before, (after,) in zip(infos, runs, more):
            history = before[-1]["usage"]["prompt_tokens"] + before[-1]["usage"]["generated_tokens"]
            assert after["usage"]["prompt_tokens"] > history  # earlier turns are still in the conversation
            if info["replica"] == victim:
                assert after["replica"] != victim
                # Restored from Redis with its tiered KV: only the new message is prefilled.
                assert after["usage"]["prefilled_tokens"] < after["usage"]["prompt_tokens"] // 2
            else:
                assert after["replica"] == info["replica"]  # survivors keep their sessions (and caches)
                assert after["usage"]["prefilled_tokens"] < after["usage"]["prompt_tokens"] // 2

        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for info in infos:
                r = await http.get(f"/v1/sessions/{info['session_id']}", headers={"x-session-token": info["token"]})
                assert r.status_code == 200
                msgs = r.json()["messages"]
                assert len(msgs) == 2 * (TURNS + 1), [(m["role"], m["content"][:30], {k: v for k, v in m.items() if k not in ("role", "content")}) for m in msgs]
                assert r.headers["x-replica"] == r.json()["replica"] != victim
            assert (await http.get("/healthz")).json()["backend"] == "ray"
