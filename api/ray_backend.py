"""``Backend`` over Ray Serve: each call goes to the chat replica that holds its session.

Calls carry the session id as ``multiplexed_model_id``, which ``SessionAffinityRouter`` keys on.
Replica results come back as ``{"ok": value}`` or ``{"error": {code, message}}`` so that engine
errors cross the Ray boundary as data. A call whose replica died before answering is retried
(with backoff, up to ``request_retry_s``) and lands on a survivor, which restores the session
from Redis; a turn cut off mid-stream ends with ``replica_unavailable``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions
from ray.serve.handle import DeploymentHandle

from api.backend import Backend
from api.errors import error_event
from api.wire import wire_event
from app.contract.errors import ChatError, ReplicaUnavailable, StoreUnavailable
from app.contract.events import TurnStarted
from app.contract.ids import is_session_id, new_session_id
from app.settings import ServerSettings
from app.session_store import SessionStore

log = logging.getLogger(__name__)
RETRYABLE = tuple(
    exc
    for exc in (
        getattr(ray_exceptions, "RayActorError", None),
        getattr(ray_exceptions, "ActorUnavailableError", None),
        getattr(serve_exceptions, "BackPressureError", None),
        getattr(serve_exceptions, "DeploymentUnavailableError", None),
    )
    if exc is not None
)


def _routable(sid: Any) -> str:
    """The id as a routing key; anything that cannot be a session id routes like a new request
    (the replica answers it ``session_not_found``)."""
    return sid if is_session_id(sid) else ""


def unwrap(result: dict[str, Any]) -> Any:
    if "error" in result:
        raise ChatError.from_code(result["error"]["code"], result["error"]["message"])
    return result["ok"]


class RayBackend(Backend):
    kind = "ray"

    def __init__(self, handle: DeploymentHandle, settings: ServerSettings, replica: str, model_name: str):
        self.handle = handle
        self.replica = replica
        self.model_name = model_name
        self.retry_s = settings.request_retry_s
        self.store = (
            SessionStore(settings.redis_url, settings.redis_namespace, settings.redis_ttl_s)
            if settings.redis_url
            else None
        )

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

    def _to(self, sid: str, stream: bool = False):
        return self.handle.options(multiplexed_model_id=sid or "", stream=stream)

    async def _retrying(self, attempt):
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            try:
                return await attempt()
            except RETRYABLE as exc:
                if time.monotonic() + delay > deadline:
                    raise ReplicaUnavailable(f"no chat replica could take the request: {exc}") from None
                log.info("replica unavailable (%s); retrying in %.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _call(self, sid: str, method: str, *args) -> Any:
        return unwrap(await self._retrying(lambda: getattr(self._to(sid), method).remote(*args)))

    async def create_session(self, mode, budget, system, owner=None):
        sid = new_session_id()
        return await self._call(sid, "create", sid, mode, budget, system, owner)

    async def import_session(self, data, owner=None):
        sid = new_session_id()
        return await self._call(sid, "import_session", sid, data, owner)

    async def resume(self, sid, token, owner=None):
        return await self._call(_routable(sid), "resume", sid, token, owner)

    async def get_session(self, sid, token, owner=None):
        return await self._call(_routable(sid), "get", sid, token, owner)

    async def export_session(self, sid, token, owner=None):
        return await self._call(_routable(sid), "export", sid, token, owner)

    async def delete_session(self, sid, token, owner=None):
        await self._call(_routable(sid), "delete", sid, token, owner)

    async def cancel(self, sid, token, owner=None):
        return await self._call(_routable(sid), "cancel", sid, token, owner)

    async def list_sessions(self, owner=None):
        if self.store is not None:
            try:
                return await self.store.summaries(owner=owner)
            except Exception as exc:
                message = f"the session list lives in Redis, which is unreachable: {exc}"
                raise StoreUnavailable(message) from None
        return await self._call("", "list_sessions", owner)  # without a store: one replica's view only

    async def health(self):
        if self.store is None:
            return {}
        try:
            await asyncio.wait_for(self.store.ping(), 2.0)
        except Exception as exc:
            return {"redis": {"ok": False, "error": f"{type(exc).__name__}: {exc}"}}
        return {"redis": {"ok": True}}

    async def stats(self):
        if self.store is None:
            return {**await self._call("", "stats"), "replicas": 1}
        totals: dict[str, Any] = {"replicas": 0}
        for replica in await self.store.replica_stats():
            totals["replicas"] += 1
            for key, value in replica.items():
                if isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0) + value
        return totals

    async def chat(self, sid, token, content, sampling, history=None, owner=None) -> AsyncIterator[dict[str, Any]]:
        deadline = time.monotonic() + self.retry_s
        delay, started = 0.1, False
        while True:
            gen = self._to(_routable(sid), stream=True).chat.remote(sid, token, content, sampling, history, owner)
            committed = False  # once text has gone out, a retry would repeat it
            try:
                async for event in gen:
                    if event.type == TurnStarted.type:
                        if started:
                            continue
                        started = True
                    else:
                        committed = True
                    yield wire_event(event)
                return
            except RETRYABLE as exc:
                if committed or time.monotonic() + delay > deadline:
                    log.warning("replica lost during a turn of %s (text sent: %s): %s", sid, committed, exc)
                    yield error_event(
                        "replica_unavailable", "the replica serving this session stopped; send the message again"
                    )
                    return
                # Nothing reached the client and the dead replica's turn was never saved: run it again.
                log.info("replica unavailable (%s); retrying the turn in %.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                gen.cancel()  # propagates a client's departure to the replica (no-op when finished)
