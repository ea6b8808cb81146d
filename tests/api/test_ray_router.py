"""``SessionAffinityRouter`` over stand-ins of Ray's ``RunningReplica``: what it reads of each replica
(held sessions, the room it reported through ``record_routing_stats``) and where requests go, per policy;
and that the deployment hands it the policy and polls the replicas' room."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402

from api.ray_router import SessionAffinityRouter  # noqa: E402
from app.placement import Room, routing_stats  # noqa: E402

SESSIONS = [f"s_{i:03d}" for i in range(120)]


class FakeReplica:
    """What the router reads of a ``RunningReplica``."""

    def __init__(self, unique_id: str, room: Room | None = None, held: set[str] = frozenset(),
                 released: list[str] | None = None):
        self.replica_id = SimpleNamespace(unique_id=unique_id)
        self.multiplexed_model_ids = set(held)
        self.routing_stats = {} if room is None else room.as_stats() if released is None else routing_stats(room, released)


def request(session_id: str) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id=session_id),
                           routing_context=SimpleNamespace(should_backoff=False))


def router(policy: str) -> SessionAffinityRouter:
    r = SessionAffinityRouter(deployment_id=DeploymentID(name="ChatReplica", app_name="test"),
                              handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(policy=policy)
    return r


async def route(r: SessionAffinityRouter, session_id: str, replicas: list[FakeReplica]) -> str:
    pending = request(session_id)
    [[chosen]] = await r.choose_replicas(replicas, pending)
    assert pending.routing_context.should_backoff  # a busy choice is waited for, never swapped
    return chosen.replica_id.unique_id


async def test_memory_sends_new_sessions_to_the_roomiest_replica_and_holders_keep_theirs():
    full = FakeReplica("a", Room(device_room=0, sessions=40, reported_at=1.0))
    roomy = FakeReplica("b", Room(device_room=8 * 2**30, sessions=3, session_bytes=2**28, reported_at=1.0))
    r = router("memory")
    assert {await route(r, s, [full, roomy]) for s in SESSIONS[:20]} == {"b"}
    held = FakeReplica("a", Room(device_room=0, sessions=40, reported_at=1.0), held={"s_old"})
    assert await route(r, "s_old", [held, roomy]) == "a"


async def test_a_session_its_replica_reports_released_goes_by_room_a_held_one_stays():
    """The full replica let ``s_parked`` go (parked, its state in Redis) but Ray still lists it among its
    multiplexed ids: its next turn goes to the replica with room; ``s_held``, not released, stays."""
    full = FakeReplica("a", Room(device_room=0, sessions=40, reported_at=1.0), held={"s_parked", "s_held"},
                       released=["s_parked"])
    roomy = FakeReplica("b", Room(device_room=8 * 2**30, sessions=3, session_bytes=2**28, reported_at=1.0))
    for policy in ("memory", "hash"):
        r = router(policy)
        assert await route(r, "s_held", [full, roomy]) == "a"
    r = router("memory")
    assert await route(r, "s_parked", [full, roomy]) == "b"
    assert await route(r, "s_parked", [full, roomy]) == "b"  # remembered until b lists it as held
    # With more room the full replica itself may take it back (it restores it from Redis).
    emptied = FakeReplica("a", Room(device_room=10 * 2**30, sessions=1, reported_at=1.0),
                          held={"s_parked"}, released=["s_parked"])
    assert await route(router("memory"), "s_parked", [emptied, roomy]) == "a"


async def test_a_burst_before_the_next_report_is_spread_not_piled_on_one_replica():
    """64 new sessions between two reports: each counts against its replica's reported room (its mean
    session bytes), so two replicas with nearly the same room share them."""
    r = router("memory")
    a = FakeReplica("a", Room(device_room=16 * 2**30, session_bytes=2**28, reported_at=1.0))
    b = FakeReplica("b", Room(device_room=16 * 2**30 + 2**20, session_bytes=2**28, reported_at=1.0))
    where = Counter([await route(r, s, [a, b]) for s in SESSIONS[:64]])
    assert where == {"a": 32, "b": 32}


async def test_hash_ignores_room_and_is_stable_across_routers():
    rooms = [FakeReplica("a", Room(device_room=0)), FakeReplica("b", Room(device_room=10**12)), FakeReplica("c")]
    one, two = router("hash"), router("hash")
    first = {s: await route(one, s, rooms) for s in SESSIONS}
    assert set(first.values()) == {"a", "b", "c"}
    assert first == {s: await route(two, s, rooms[::-1]) for s in SESSIONS}


async def test_requests_without_a_session_get_two_choices():
    r = router("memory")
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    [chosen] = await r.choose_replicas(replicas, request(""))
    assert len(chosen) == 2
    assert await r.choose_replicas([], request("s_1")) == []


def test_the_deployment_passes_the_policy_and_polls_the_replicas_room():
    from api.deployment import ROUTING_STATS_S, ChatReplica, build_app
    from app.settings import ServerSettings

    chat = build_app(ServerSettings(placement="hash", num_gpus=0))._bound_deployment.init_args[0]._bound_deployment
    config = chat._deployment_config.request_router_config
    assert config.request_router_kwargs == {"policy": "hash"}
    assert config.request_routing_stats_period_s == ROUTING_STATS_S
    assert callable(getattr(ChatReplica, "record_routing_stats", None))
    assert ServerSettings().placement == "memory"
