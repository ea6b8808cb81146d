"""The one implementation of ``app.contract.service.SessionService``: the session verbs as the routes
call them, over a chat replica in this process or over Ray Serve replicas.

What differs between the two is a ``Transport``: how a verb reaches a replica (``LocalTransport``
here, ``api.ray_transport.RayTransport``), and which of its failures mean "that replica is gone,
try again" (none in-process). Everything else is here, once: ids of new sessions, one retrying
call with one error translation (``unwrap``), and turns that are retried under one idempotency
key, so that a turn cut off by a dying replica is resumed rather than run twice.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from app.contract.errors import ReplicaUnavailable
from app.contract.events import Delta, TurnEvent, TurnFailed, TurnStarted
from app.contract.ids import is_session_id, new_session_id, new_turn_key
from app.contract.service import VERBS, outcome, unwrap

if TYPE_CHECKING:  # the service pulls in torch; a Ray ingress only needs this module's interface
    from app.chat_service import ChatService
    from app.session_store import SessionStore

log = logging.getLogger(__name__)
HEALTH_WAIT_S = 0.5  # a health probe with a 1-second timeout still hears "degraded" from a hung Redis
LOST = "the replica serving this session stopped; send the message again"


class Transport(Protocol):
    kind: str
    fleet: bool  # many replicas: totals and health come from Redis, where each one reports
    retryable: tuple[type[BaseException], ...]  # failures after which another attempt may succeed

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def call(self, sid: str, verb: str, *args: Any) -> dict[str, Any]:
        """``verb``'s ``outcome`` data from the replica that ``sid`` routes to."""
        ...

    def stream(self, sid: str, *args: Any) -> AsyncIterator[TurnEvent]:
        """The events of ``chat(*args)`` from the replica that ``sid`` routes to."""
        ...


class LocalTransport:
    """A replica's service in this process (tests, ``serve --no-ray``)."""

    kind = "local"
    fleet = False
    retryable: tuple[type[BaseException], ...] = ()

    def __init__(self, service: "ChatService"):
        self.service = service

    async def start(self) -> None:
        self.service.start()

    async def close(self) -> None:
        await self.service.close()

    async def call(self, sid: str, verb: str, *args: Any) -> dict[str, Any]:
        if verb not in VERBS:
            raise ValueError(f"{verb!r} is not a session verb")
        return await outcome(getattr(self.service, verb)(*args))

    def stream(self, sid: str, *args: Any) -> AsyncIterator[TurnEvent]:
        return self.service.chat(*args)


def _routable(sid: Any) -> str:
    """The id as a routing key; anything that cannot be a session id routes like a new request
    (the replica answers it ``session_not_found``)."""
    return sid if is_session_id(sid) else ""


class ServiceClient:
    def __init__(
        self,
        transport: Transport,
        model_name: str,
        replica: str,
        store: "SessionStore | None" = None,
        retry_s: float = 0.0,
    ):
        self.transport = transport
        self.kind = transport.kind
        self.model_name = model_name
        self.replica = replica
        self.store = store  # session summaries (listings), and a fleet's totals and health
        self.retry_s = retry_s

    async def start(self) -> None:
        await self.transport.start()

    async def close(self) -> None:
        await self.transport.close()
        if self.store is not None:
            await self.store.close()

    # --- one retrying call ---------------------------------------------------------------------
    async def _backoff(self, deadline: float, delay: float, exc: BaseException) -> float:
        """Sleep before the next attempt and return the delay after it; ``ReplicaUnavailable`` past
        the deadline."""
        if time.monotonic() + delay > deadline:
            raise ReplicaUnavailable(f"no chat replica could take the request: {exc}") from None
        log.info("replica unavailable (%s); retrying in %.1fs", type(exc).__name__, delay)
        await asyncio.sleep(delay)
        return min(delay * 2, 2.0)

    async def _call(self, sid: str, verb: str, *args: Any) -> Any:
        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            try:
                return unwrap(await self.transport.call(_routable(sid), verb, *args))
            except self.transport.retryable as exc:
                delay = await self._backoff(deadline, delay, exc)

    # --- sessions ------------------------------------------------------------------------------
    async def create_session(self, mode, budget, system, owner=None):
        sid = new_session_id()
        return await self._call(sid, "create_session", sid, mode, budget, system, owner)

    async def import_session(self, data, owner=None):
        sid = new_session_id()
        return await self._call(sid, "import_session", sid, data, owner)

    async def resume_session(self, sid, token, owner=None):
        return await self._call(sid, "resume_session", sid, token, owner)

    async def get_session(self, sid, token, owner=None):
        return await self._call(sid, "get_session", sid, token, owner)

    async def export_session(self, sid, token, owner=None):
        return await self._call(sid, "export_session", sid, token, owner)

    async def memory_map(self, sid, token, owner=None, text=False):
        return await self._call(sid, "memory_map", sid, token, owner, text)

    async def delete_session(self, sid, token, owner=None):
        return await self._call(sid, "delete_session", sid, token, owner)

    async def cancel_turn(self, sid, token, owner=None):
        return await self._call(sid, "cancel_turn", sid, token, owner)

    async def list_sessions(self, owner=None):
        """The caller's sessions: the ones the answering replica holds, and every one Redis keeps
        (all replicas'); without Redis, or while it is down, the answering replica's only."""
        held = await self._call("", "list_sessions", owner)
        if self.store is None:
            return held
        try:
            stored = await self.store.summaries(owner=owner)
        except Exception:  # Redis down: what the replica holds is still a true answer
            return held
        ids = {s["session_id"] for s in held}
        return held + [s for s in stored if s["session_id"] not in ids]

    async def stats(self):
        if not self.transport.fleet or self.store is None:
            return {**await self._call("", "stats"), "replicas": 1}
        try:
            replicas = await self.store.replica_stats()
        except Exception:  # the totals' Redis (or its cluster shard) is out: the answering replica's are true
            return {**await self._call("", "stats"), "replicas": 1}
        totals: dict[str, Any] = {"replicas": 0}
        for replica in replicas:
            totals["replicas"] += 1
            for key, value in replica.items():
                if isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0) + value
        return totals

    async def health(self):
        if not self.transport.fleet:
            return await self._call("", "health")
        if self.store is None:
            return {}
        error = await self.store.client.check(HEALTH_WAIT_S)  # bounded, and at once while its circuit is open
        return {"redis": {"ok": True}} if error is None else {"redis": {"ok": False, "error": error}}

    # --- turns ---------------------------------------------------------------------------------
    async def chat(self, sid, token, content, sampling, history=None, owner=None, turn_key=None):
        """One turn; every attempt carries the same idempotency key. An attempt cut off by a replica
        that died is sent again: the turn then either comes back finished (its replica kept it) or
        runs once elsewhere. Its reply restarts from the beginning, so only the text past what the
        caller already has goes out; a reply that differs from it cannot be resumed and ends the turn
        with ``replica_unavailable``."""
        args = (sid, token, content, sampling, history, owner, turn_key or new_turn_key())
        deadline, delay = time.monotonic() + self.retry_s, 0.1
        started, sent = False, ""
        while True:
            text = ""  # this attempt's reply so far
            try:
                async with contextlib.aclosing(self.transport.stream(_routable(sid), *args)) as events:
                    async for event in events:
                        if isinstance(event, TurnStarted):
                            if not started:
                                started = True
                                yield event
                        elif isinstance(event, Delta):
                            text += event.text
                            if not (text.startswith(sent) or sent.startswith(text)):
                                log.warning("turn of %s: the retried reply differs from the text sent", sid)
                                yield TurnFailed("replica_unavailable", LOST)
                                return
                            if len(text) > len(sent):
                                yield Delta(text[len(sent):])
                                sent = text
                        else:
                            yield event
                return
            except self.transport.retryable as exc:
                try:
                    delay = await self._backoff(deadline, delay, exc)
                except ReplicaUnavailable:
                    log.warning("replica lost during a turn of %s (%d characters sent): %s", sid, len(sent), exc)
                    yield TurnFailed("replica_unavailable", LOST)
                    return
