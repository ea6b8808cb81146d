"""A real multi-node Ray cluster on loopback: a head and two worker nodes, one chat replica on each worker.

``ray.cluster_utils.Cluster`` starts each node as this machine's processes (a raylet and an object
store each, the GCS on the head), as ``ray start --head`` / ``ray start --address`` would on many
machines; the application joins it through ``RKV_RAY_ADDRESS`` (``ray_address``). Sessions are
served by replicas on different nodes and stay on theirs; a worker node killed mid-turn
(``remove_node``: SIGKILL to its processes, replica included) moves its sessions to the survivor,
which restores them from Redis with their KV: a ``tiered`` session then prefills only its new turn.
Turns carry idempotency keys, so no finished turn is lost or run twice.
"""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from serving_helpers import WsChat, deploy_on_a_free_port, free_port

from bench.cluster_serve import replica_nodes

pytestmark = pytest.mark.slow

LOOPBACK = "127.0.0.1"
CHAT = "chat"  # the custom resource worker nodes offer and replicas ask for; the head offers none
SESSIONS_PER_REPLICA = 2
# The GCS declares a node dead after 3 missed one-second probes (the defaults take tens of seconds).
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                   "health_check_failure_threshold": 3}
NODE = {"num_cpus": 1, "node_ip_address": LOOPBACK, "object_store_memory": 80 * 1024**2}


@pytest.fixture(scope="module")
def cluster(redis_url):
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as ray_constants
    from ray import serve
    from ray.cluster_utils import Cluster

    from api.deployment import deploy
    from app.settings import ServerSettings

    patch = pytest.MonkeyPatch()
    # Ray maps a loopback address to the host's own, for nodes on other machines; all of these nodes
    # are on this one, and their traffic stays on loopback.
    patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    patch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")  # the nodes' own processes too
    namespace = f"rkv-nodes-{uuid.uuid4().hex[:8]}"
    nodes = None
    try:
        try:
            nodes = Cluster(initialize_head=True, head_node_args={
                **NODE, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
            workers = [nodes.add_node(**NODE, resources={CHAT: 1}) for _ in range(2)]
            nodes.wait_for_nodes()
        except Exception as exc:  # no Ray nodes here (a sandbox without the ports or processes they need)
            pytest.skip(f"ray cannot start a three-node cluster here: {type(exc).__name__}: {exc}")
        settings = ServerSettings(
            host=LOOPBACK,
            port=free_port(),
            ray_address=nodes.address,
            num_replicas=2,
            replica_num_cpus=1,
            replica_resources={CHAT: 1},
            threads=1,
            mode="tiered",
            max_new_tokens=8,
            redis_url=redis_url,
            redis_namespace=namespace,
            request_retry_s=90,
        )
        settings = deploy_on_a_free_port(settings, deploy, serve)
        yield SimpleNamespace(nodes=nodes, workers=workers, settings=settings)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if nodes is not None:
            nodes.shutdown()
        patch.undo()
        import redis

        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(match=f"{namespace}:*"):
            r.delete(key)


async def turn(chat: WsChat, content: str, key: str, max_tokens: int = 8,
               streaming: asyncio.Event | None = None) -> tuple[str, dict]:
    """One turn under an idempotency key: its reply and final event (``done`` or ``error``)."""
    await chat.send({"type": "message", "content": content, "max_tokens": max_tokens, "idempotency_key": key})
    text = ""
    while True:
        event = await chat.recv(timeout=180)
        if event["type"] != "delta":
            return text, event
        text += event["text"]
        if streaming is not None:
            streaming.set()


def new_tokens(done: dict, before: dict) -> int:
    """Tokens a turn added to the conversation: its prompt less everything up to the turn ``before``."""
    return done["usage"]["prompt_tokens"] - before["usage"]["prompt_tokens"] - before["usage"]["generated_tokens"]


def message(i: int, k: int) -> str:
    # Longer than the session's budget of 32 tokens: each turn demotes pages, which go to Redis.
    return f"Session {i}, note {k}: the keeper of lighthouse {i} counted {7 * k + i} gulls over the harbour today."


async def test_sessions_spread_over_nodes_and_move_with_their_kv_when_a_node_dies(cluster):
    placed = replica_nodes()
    head = cluster.nodes.head_node.node_id
    assert len(placed) == 2 and len(set(placed.values())) == 2 and head not in placed.values(), placed
    ws_url = f"ws://{LOOPBACK}:{cluster.settings.port}/v1/chat/ws"
    async with contextlib.AsyncExitStack() as stack:
        # New sessions go where the placement puts them: open some until each replica holds two.
        sessions, held = [], Counter()
        for _ in range(16):
            chat = await stack.enter_async_context(WsChat.open(ws_url))
            info = await chat.create(mode="tiered", budget=32)
            if held[info["replica"]] < SESSIONS_PER_REPLICA:
                held[info["replica"]] += 1
                sessions.append((chat, info))
            if len(sessions) == SESSIONS_PER_REPLICA * len(placed):
                break
        assert set(held) == set(placed) and len(sessions) == 4, held
        dones: list[list[dict]] = [[] for _ in sessions]
        replies: list[list[str]] = [[] for _ in sessions]

        async def converse(i: int, k: int) -> None:
            chat, info = sessions[i]
            text, done = await turn(chat, message(i, k), f"{info['session_id']}-{k}")
            assert done["type"] == "done", done
            dones[i].append(done)
            replies[i].append(text)

        for k in range(2):
            await asyncio.gather(*(converse(i, k) for i in range(len(sessions))))
        for (_, info), ds in zip(sessions, dones):
            assert {d["replica"] for d in ds} == {info["replica"]}, "a session left its replica"
        # Sessions on both nodes: served by replicas whose processes run on different Ray nodes.
        assert {placed[info["replica"]] for _, info in sessions} == set(placed.values())

        # Mid-turn, the node of one replica dies with everything on it.
        victim = sessions[0][1]["replica"]
        survivor = next(r for r in placed if r != victim)
        doomed = next(w for w in cluster.workers if w.node_id == placed[victim])
        streaming = asyncio.Event()

        async def third(i: int) -> tuple[str, dict]:
            chat, info = sessions[i]
            moving = info["replica"] == victim
            return await turn(chat, f"Tell me a long story about lighthouse {i}.", f"{info['session_id']}-2",
                              max_tokens=48 if moving else 8, streaming=streaming if moving else None)

        turns = [asyncio.create_task(third(i)) for i in range(len(sessions))]
        await asyncio.wait_for(streaming.wait(), 180)
        await asyncio.to_thread(cluster.nodes.remove_node, doomed, allow_graceful=False)
        outcomes = await asyncio.gather(*turns)

        for i, ((chat, info), (text, event)) in enumerate(zip(sessions, outcomes)):
            if event["type"] == "error":
                # Cut off where the retried reply could not continue the text already sent: nothing
                # was committed, and the client sends the turn again under its key.
                assert event["code"] == "replica_unavailable", event
                text, event = await turn(chat, f"Tell me a long story about lighthouse {i}.",
                                         f"{info['session_id']}-2", max_tokens=48)
            assert event["type"] == "done", event
            dones[i].append(event)
            replies[i].append(text)
            if info["replica"] != victim:
                assert event["replica"] == info["replica"]  # the survivor's own sessions did not move

        # Every session's next turn: the moved ones now live on the survivor's node.
        await asyncio.gather(*(converse(i, 3) for i in range(len(sessions))))
        for (_, info), ds in zip(sessions, dones):
            assert ds[-1]["replica"] == (survivor if info["replica"] == victim else info["replica"]), ds
            # On its holder a turn prefills its new tokens (and the previous reply's last token): every
            # turn prefills that much, the first one a survivor serves after the move, restored from
            # Redis with its KV, included; a restore without the KV would prefill the whole history.
            extra = ds[1]["usage"]["prefilled_tokens"] - new_tokens(ds[1], ds[0])
            assert 0 <= extra <= 2, ds
            for before, done in zip(ds, ds[1:]):
                assert done["usage"]["prefilled_tokens"] == new_tokens(done, before) + extra, ds
        assert placed[survivor] != placed[victim]

        # A finished turn sent again under its key is answered from the record, not run again.
        for i, (chat, info) in enumerate(sessions):
            _, again = await turn(chat, message(i, 3), f"{info['session_id']}-3")
            assert again["type"] == "done" and again["usage"] == dones[i][-1]["usage"], again

        async with httpx.AsyncClient(base_url=f"http://{LOOPBACK}:{cluster.settings.port}", timeout=60) as http:
            for i, (_, info) in enumerate(sessions):
                r = await http.get(f"/v1/sessions/{info['session_id']}", headers={"x-session-token": info["token"]})
                assert r.status_code == 200, r.text
                # Each turn once, in order, with the reply its client got.
                messages = [(m["role"], m["content"]) for m in r.json()["messages"]]
                asked = [message(i, 0), message(i, 1), f"Tell me a long story about lighthouse {i}.", message(i, 3)]
                assert messages == [pair for q, a in zip(asked, replies[i]) for pair in (("user", q), ("assistant", a))]
