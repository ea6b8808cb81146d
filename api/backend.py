"""What the HTTP layer needs from whatever runs the sessions, and the in-process implementation.

The routes only see a ``Backend``: ``LocalBackend`` calls a ``ChatService`` in this process;
``api.ray_backend.RayBackend`` sends each call to the Ray Serve replica that holds the session.
Unary calls raise ``app.contract.errors`` classes; ``chat`` yields wire event dicts
(``api.wire``) and reports failures as one ``error`` event. ``owner`` is the caller's identity (``api.auth``; None without API keys): a
session answers only to its owner and its token.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from api.wire import wire_event
from app.contract.ids import new_session_id

if TYPE_CHECKING:  # the service pulls in torch; a Ray ingress only needs this module's interface
    from app.chat_service import ChatService


class Backend(ABC):
    kind: str = "abstract"
    replica: str = "unknown"  # who answers requests that no session replica handled
    model_name: str = "unknown"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @abstractmethod
    async def create_session(
        self, mode: str | None, budget: int | None, system: str | None, owner: str | None = None
    ) -> dict[str, Any]: ...

    @abstractmethod
    async def import_session(self, data: dict[str, Any], owner: str | None = None) -> dict[str, Any]: ...

    @abstractmethod
    async def resume(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]: ...

    @abstractmethod
    async def get_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]: ...

    @abstractmethod
    async def export_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]: ...

    @abstractmethod
    async def delete_session(self, sid: str, token: str | None, owner: str | None = None) -> None: ...

    @abstractmethod
    async def cancel(self, sid: str, token: str | None, owner: str | None = None) -> bool: ...

    @abstractmethod
    async def list_sessions(self, owner: str | None = None) -> list[dict[str, Any]]: ...

    @abstractmethod
    def chat(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any],
        history: list[list[str]] | None = None,
        owner: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]: ...

    @abstractmethod
    async def stats(self) -> dict[str, Any]:
        """Totals over all replicas: sessions, device/host/redis bytes, promotions, demotions."""

    async def health(self) -> dict[str, Any]:
        """``{"redis": {"ok", "error"}, "unsaved_sessions"}`` where Redis is configured; ``{}`` without it."""
        return {}


class LocalBackend(Backend):
    kind = "local"

    def __init__(self, service: "ChatService", model_name: str):
        self.service = service
        self.replica = service.replica
        self.model_name = model_name

    async def start(self) -> None:
        self.service.start()

    async def close(self) -> None:
        await self.service.close()

    async def _call(self, method, *args):
        return await method(*args)  # the service's errors are the contract's: the routes answer them

    async def create_session(self, mode, budget, system, owner=None):
        return await self._call(self.service.create, new_session_id(), mode, budget, system, owner)

    async def import_session(self, data, owner=None):
        return await self._call(self.service.import_session, new_session_id(), data, owner)

    async def resume(self, sid, token, owner=None):
        return await self._call(self.service.resume, sid, token, owner)

    async def get_session(self, sid, token, owner=None):
        return await self._call(self.service.get, sid, token, owner)

    async def export_session(self, sid, token, owner=None):
        return await self._call(self.service.export, sid, token, owner)

    async def delete_session(self, sid, token, owner=None):
        await self._call(self.service.delete, sid, token, owner)

    async def cancel(self, sid, token, owner=None):
        return await self._call(self.service.cancel, sid, token, owner)

    async def list_sessions(self, owner=None):
        local = await self.service.list_sessions(owner)
        if self.service.store is None:
            return local
        held = {s["session_id"] for s in local}
        try:
            stored = await self.service.store.summaries(owner=owner)
        except Exception:  # Redis down: what this replica holds is still a true answer
            return local
        return local + [s for s in stored if s["session_id"] not in held]

    async def chat(self, sid, token, content, sampling, history=None, owner=None):
        # aclosing: a caller that leaves early closes the service's turn now (it ends as cancelled).
        async with contextlib.aclosing(self.service.chat(sid, token, content, sampling, history, owner)) as events:
            async for event in events:
                yield wire_event(event)

    async def stats(self):
        return self.service.stats()

    async def health(self):
        return await self.service.health()
