"""The one client class of the session service, over a scripted transport (pure logic, no model):
one retrying call with one error translation, and turns retried under one idempotency key."""
from __future__ import annotations

import pytest

from api.service_client import ServiceClient
from app.contract.errors import ReplicaUnavailable, SessionNotFound
from app.contract.events import Delta, Done, MemoryStats, TurnFailed, TurnStarted, Usage


class ReplicaGone(Exception):
    """What the transport raises when the replica it called died."""


DONE = Done("stop", Usage(10, 10, 2), MemoryStats(0), "b", "s_x")


class ScriptedTransport:
    """Each attempt of a turn plays the next script: its events, then (maybe) the replica dying."""

    kind = "scripted"
    fleet = False
    retryable = (ReplicaGone,)

    def __init__(self, turns=(), calls=()):
        self.turns, self.calls = list(turns), list(calls)
        self.turn_args: list[tuple] = []
        self.verbs: list[tuple] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def call(self, sid, verb, *args):
        self.verbs.append((sid, verb, args))
        result = self.calls.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    async def stream(self, sid, *args):
        self.turn_args.append(args)
        events, dies = self.turns.pop(0)
        for event in events:
            yield event
        if dies:
            raise ReplicaGone("the replica died")


async def turn(client: ServiceClient, **kwargs) -> list:
    return [e async for e in client.chat("s_x", "token", "Hi", {}, **kwargs)]


async def test_a_turn_cut_off_mid_reply_resumes_where_the_caller_is_under_one_key():
    transport = ScriptedTransport(turns=[
        ([TurnStarted("s_x", "a"), Delta("Hel")], True),  # died mid-reply
        ([], True),  # the router still picked the dead replica
        ([TurnStarted("s_x", "b"), Delta("Hello"), Delta(" you"), DONE], False),  # found finished, or run once
    ])
    events = await turn(ServiceClient(transport, "m", "ingress", retry_s=10))
    assert events == [TurnStarted("s_x", "a"), Delta("Hel"), Delta("lo"), Delta(" you"), DONE]
    keys = {args[-1] for args in transport.turn_args}
    assert len(transport.turn_args) == 3 and len(keys) == 1 and None not in keys


async def test_the_callers_key_is_the_turns_and_a_reply_that_differs_is_not_resumed():
    transport = ScriptedTransport(turns=[
        ([TurnStarted("s_x", "a"), Delta("Blue")], True),
        ([TurnStarted("s_x", "b"), Delta("Red"), DONE], False),
    ])
    events = await turn(ServiceClient(transport, "m", "ingress", retry_s=10), turn_key="mine")
    assert events[:2] == [TurnStarted("s_x", "a"), Delta("Blue")]
    assert events[2:] == [TurnFailed("replica_unavailable", events[2].message)]
    assert [args[-1] for args in transport.turn_args] == ["mine", "mine"]


async def test_a_turn_whose_replicas_stay_gone_ends_replica_unavailable():
    transport = ScriptedTransport(turns=[([], True)] * 3)
    events = await turn(ServiceClient(transport, "m", "ingress", retry_s=0.25))
    assert [type(e) for e in events] == [TurnFailed] and events[0].code == "replica_unavailable"


async def test_unary_calls_retry_then_translate_the_replicas_error():
    transport = ScriptedTransport(calls=[
        ReplicaGone("dead"), {"ok": {"session_id": "s_new"}},
        ReplicaGone("dead"), {"error": {"code": "session_not_found", "message": "no session"}},
    ])
    client = ServiceClient(transport, "m", "ingress", retry_s=10)
    created = await client.create_session("tiered", None, None)
    assert created == {"session_id": "s_new"}
    (sid, verb, args), (again, _, args_again) = transport.verbs[:2]
    assert verb == "create_session" and sid == again == args[0] == args_again[0]  # one id, routed the same
    with pytest.raises(SessionNotFound):
        await client.get_session("s_gone", "token")
    assert transport.verbs[-1] == ("s_gone", "get_session", ("s_gone", "token", None))
    with pytest.raises(ReplicaUnavailable):
        await ServiceClient(ScriptedTransport(calls=[ReplicaGone("dead")] * 5), "m", "i", retry_s=0.2).stats()
    # Not an id: routed like a new request (the replica refuses it), never as a key.
    transport = ScriptedTransport(calls=[{"error": {"code": "session_not_found", "message": "no such session"}}])
    with pytest.raises(SessionNotFound):
        await ServiceClient(transport, "m", "i").resume_session("s_*:kv", "t")
    assert transport.verbs[0][0] == ""


class UnreadableTotals:
    """A store whose replicas' totals cannot be read (their Redis, or cluster shard, is out)."""

    async def replica_stats(self):
        raise ConnectionError("the shard of the totals is down")


async def test_a_fleets_stats_fall_back_to_the_answering_replica_when_the_totals_cannot_be_read():
    transport = ScriptedTransport(calls=[{"ok": {"replica": "a", "sessions": 3}}])
    transport.fleet = True
    stats = await ServiceClient(transport, "m", "ingress", store=UnreadableTotals()).stats()
    assert stats == {"replica": "a", "sessions": 3, "replicas": 1}
