"""Redis going back in time (restarted from a snapshot one turn old, as a failover to a lagging replica or a
crash under ``appendfsync everysec`` leaves it) while two replicas hold a session: no turn acknowledged on
the restored state is overwritten by the copy that diverged, which stops serving and reports the loss; a
copy nobody went on from saves its state back; a turn the store itself lost was not acknowledged as
durable. Real model, a private Redis restarted from an RDB snapshot."""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil

import pytest
from replica_helpers import LONG, events_of, new_session, replica, turn
from serving_helpers import RedisServer

from app.contract.events import Done, TurnFailed
from app.session_store import SessionStore
from bench.soak_checks import missing_groups, orphan_keys


class Snapshots:
    """A private Redis whose state can be saved to a file and restored from it (RDB, no AOF)."""

    def __init__(self, server):
        self.server = server
        self.rdb = os.path.join(server.dir, "dump.rdb")

    def take(self) -> str:
        self.server.client().save()
        kept = os.path.join(self.server.dir, f"snapshot-{secrets.token_hex(3)}.rdb")
        shutil.copy(self.rdb, kept)
        return kept

    def restore(self, snapshot: str) -> None:
        """Redis killed and started again from ``snapshot``: every write since is lost."""
        self.server.stop()
        shutil.copy(snapshot, self.rdb)
        self.server.start()


@pytest.fixture
def snapshots(tmp_path):
    with RedisServer(tmp_path, aof=False) as server:
        yield Snapshots(server)


@contextlib.contextmanager
def replies_lost(service):
    """Every commit of ``service`` lands, and its reply never comes back (a timeout, a reset)."""
    commit = service.store.save

    async def reply_lost(*args, **kwargs):
        await commit(*args, **kwargs)
        raise ConnectionError("the reply was lost")

    service.store.save = reply_lost
    try:
        yield
    finally:
        service.store.save = commit


@contextlib.contextmanager
def no_saving_back(service):
    """``service``'s housekeeping saves nothing again meanwhile (it would save its copy on top first)."""
    save_unsaved = service.repository.save_unsaved

    async def not_yet(*_):
        return None

    service.repository.save_unsaved = not_yet
    try:
        yield
    finally:
        service.repository.save_unsaved = save_unsaved


def users(messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


async def history(service, sid, token) -> list[str]:
    return users((await service.get_session(sid, token))["messages"])


async def test_a_copy_that_diverged_from_a_rolled_back_store_stops_serving_and_never_overwrites(make_engine,
                                                                                               snapshots):
    ns = f"rkvroll-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, snapshots.server.url, ns, name) for name in ("a", "b"))
    try:
        sid, token = await new_session(a)
        before = snapshots.take()  # the store as it was after A's first turn
        second = await turn(a, sid, token, "What did the keeper write about?")
        assert second.storage.saved and not second.storage.durable  # a lone Redis without fsync promises no more
        snapshots.restore(before)  # A's second turn is lost by the store; A's copy still holds it

        # B restores the older state and answers a new turn on it: acknowledged.
        with no_saving_back(a):  # (else A may save its state back first: no divergence then)
            moved = await turn(b, sid, token, "My favourite number is 42.")
        assert moved.storage.saved
        assert await history(b, sid, token) == [LONG, "My favourite number is 42."]

        # A's copy diverged: its next request is refused with the loss, never saved over B's turn.
        failed = (await events_of(a, sid, token, "And the gulls?"))[-1]
        assert isinstance(failed, TurnFailed) and failed.code == "session_diverged", failed
        assert sid not in a.engine.sessions and a.repository.counts["divergences"] == 1
        stored, _ = await SessionStore(a.store.client, ns).load(sid)
        assert users(stored["messages"]) == [LONG, "My favourite number is 42."]

        # Sent again, A restores the stored state and the turn runs on it, after B's.
        again = (await events_of(a, sid, token, "And the gulls?"))[-1]
        assert isinstance(again, Done), again
        assert await history(a, sid, token) == [LONG, "My favourite number is 42.", "And the gulls?"]
        redis = snapshots.server.client()
        assert missing_groups(redis, ns) == []
    finally:
        await a.close()
        await b.close()


async def test_a_copy_the_store_fell_behind_saves_its_state_back(make_engine, snapshots):
    ns = f"rkvroll-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, snapshots.server.url, ns, name) for name in ("a", "b"))
    try:
        sid, token = await new_session(a)
        before = snapshots.take()
        await turn(a, sid, token, "What did the keeper write about?")
        snapshots.restore(before)  # the store lost A's second turn; nobody went on from the older state
        await turn(a, sid, token, "And the gulls?")  # A's copy is the truth: saved back, then on
        assert a.repository.counts["store_losses"] == 1
        want = [LONG, "What did the keeper write about?", "And the gulls?"]
        assert await history(a, sid, token) == want
        # Another replica restores exactly that, KV included (only the new turn prefilled).
        fed = a.engine.sessions[sid].fed_tokens
        again = await turn(b, sid, token, "And the ships?")
        assert again.usage.prefilled_tokens == again.usage.prompt_tokens - fed
        assert await history(b, sid, token) == [*want, "And the ships?"]
        redis = snapshots.server.client()
        assert missing_groups(redis, ns) == [] and orphan_keys(redis, ns) == []
    finally:
        await a.close()
        await b.close()


async def test_a_store_that_lost_the_record_gets_it_back_from_the_copy(make_engine, snapshots):
    ns = f"rkvroll-{secrets.token_hex(3)}"
    a = replica(make_engine, snapshots.server.url, ns, "a")
    try:
        empty = snapshots.take()  # before the session existed
        sid, token = await new_session(a)
        await turn(a, sid, token, "What did the keeper write about?")
        snapshots.restore(empty)
        await a._drop_stale()  # housekeeping finds the record gone: the copy is saved back
        await a.repository.save_unsaved(a.access.digest)
        stored, _ = await a.store.load(sid)
        assert users(stored["messages"]) == [LONG, "What did the keeper write about?"]
        assert stored["kv"] is not None and missing_groups(snapshots.server.client(), ns) == []
    finally:
        await a.close()


async def test_a_commit_whose_reply_was_lost_is_found_to_be_this_copy_s_own(make_engine, private_redis):
    """The commit ran but its reply never came back (a timeout, a reset): the turn is told it was not saved,
    and the copy learns from the stored tag, at its next look, that it was. Nothing is abandoned meanwhile,
    so the record's KV stays whole, and the copy is not taken for one another replica moved on from."""
    a = replica(make_engine, private_redis.url, f"rkvlost-{secrets.token_hex(3)}", "a")
    try:
        sid, token = await new_session(a)
        with replies_lost(a):
            told = await turn(a, sid, token, "What did the keeper write about?")
        assert not told.storage.saved
        assert await a.repository.check(sid) == "mine"
        await a.repository.save_unsaved(a.access.digest)
        assert a.repository.stored(sid) and sid not in a.repository.stale
        assert missing_groups(private_redis.client(), a.store.ns) == []
        await turn(a, sid, token, "And the gulls?")
        assert await history(a, sid, token) == [LONG, "What did the keeper write about?", "And the gulls?"]
    finally:
        await a.close()


async def test_a_landed_commit_whose_reply_was_lost_keeps_its_kv_for_the_replica_that_went_on(make_engine,
                                                                                             private_redis):
    """A's commit landed but its reply was lost; B restored that record and went on, naming A's pages. A,
    finding the session moved on, lets its copy go without deleting a page B's record names."""
    ns = f"rkvlost-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name) for name in ("a", "b"))
    try:
        sid, token = await new_session(a)
        with no_saving_back(a):
            with replies_lost(a):
                assert not (await turn(a, sid, token, "What did the keeper write about?")).storage.saved
            moved = await turn(b, sid, token, "And the gulls?")  # restored with A's KV: the new turn prefilled
        assert moved.storage.saved and moved.usage.prefilled_tokens < moved.usage.prompt_tokens
        await a._drop_stale()  # housekeeping: moved on, let go
        assert sid not in a.engine.sessions
        redis = private_redis.client()
        assert missing_groups(redis, ns) == []
        c = replica(make_engine, private_redis.url, ns, "c")
        try:
            again = await turn(c, sid, token, "And the ships?")
            assert again.usage.prefilled_tokens < again.usage.prompt_tokens  # KV whole: no replay
        finally:
            await c.close()
    finally:
        await a.close()
        await b.close()


async def test_a_copy_found_stale_never_serves_while_redis_is_unreachable(make_engine, private_redis):
    """B went on while A ran a turn: A's turn is not kept. Redis then goes away: A's copy, known stale, is
    not served as "the best there is"; once Redis is back the session continues from B's state."""
    ns = f"rkvstale-{secrets.token_hex(3)}"
    a, b = (replica(make_engine, private_redis.url, ns, name) for name in ("a", "b"))
    try:
        sid, token = await new_session(a)
        save = a.repository.save

        async def b_goes_first(session, digest, *args, **kwargs):
            a.repository.save = save
            await turn(b, sid, token, "My favourite number is 42.")
            return await save(session, digest, *args, **kwargs)

        a.repository.save = b_goes_first
        failed = (await events_of(a, sid, token, "What did the keeper write about?"))[-1]
        assert isinstance(failed, TurnFailed) and failed.code == "session_moved", failed
        assert not a.repository.stored(sid)
        private_redis.stop()
        refused = (await events_of(a, sid, token, "And the gulls?"))[-1]
        assert isinstance(refused, TurnFailed) and refused.code == "store_unavailable", refused
        private_redis.start()
        for _ in range(40):  # until the replica's circuit lets a call through again
            if a.repository.can_save(sid):
                break
            await asyncio.sleep(0.25)
        await turn(a, sid, token, "And the gulls?")
        assert await history(a, sid, token) == [LONG, "My favourite number is 42.", "And the gulls?"]
    finally:
        await a.close()
        await b.close()
