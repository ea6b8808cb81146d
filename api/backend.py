"""What the HTTP layer needs from whatever runs the sessions, and the in-process implementation.

The routes only see a ``Backend``: ``LocalBackend`` calls a ``ChatService`` in this process;
``app.ray_backend.RayBackend`` sends each call to the Ray Serve replica that holds the session.
Unary calls raise ``ApiError``; ``chat`` yields event dicts and reports failures as one
``error`` event.
"""
from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from api.errors import ApiError
from app.engine.errors import EngineError

if TYPE_CHECKING:  # the service pulls in torch; a Ray ingress only needs this module's interface
    from app.chat_service import ChatService


def new_session_id() -> str:
    """Chosen here, before any replica is involved, because the Ray router keys on it (engine format)."""
    return "s_" + secrets.token_urlsafe(18)


class Backend(ABC):
    kind: str = "abstract"
    replica: str = "unknown"  # who answers requests that no session replica handled
    model_name: str = "unknown"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @abstractmethod
    async def create_session(self, mode: str | None, budget: int | None, system: str | None) -> dict[str, Any]: ...

    @abstractmethod
    async def import_session(self, data: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    async def resume(self, sid: str, token: str | None) -> dict[str, Any]: ...

    @abstractmethod
    async def get_session(self, sid: str, token: str | None) -> dict[str, Any]: ...

    @abstractmethod
    async def export_session(self, sid: str, token: str | None) -> dict[str, Any]: ...

    @abstractmethod
    async def delete_session(self, sid: str, token: str | None) -> None: ...

    @abstractmethod
    async def cancel(self, sid: str, token: str | None) -> bool: ...

    @abstractmethod
    async def list_sessions(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def chat(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any],
        history: list[list[str]] | None = None,
    ) -> AsyncIterator[dict[str, Any]]: ...

    @abstractmethod
    async def stats(self) -> dict[str, Any]:
        """Totals over all replicas: sessions, device/host/redis bytes, promotions, demotions."""


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
        try:
            return await method(*args)
        except EngineError as exc:
            raise ApiError(exc.code, exc.message) from None

    async def create_session(self, mode, budget, system):
        return await self._call(self.service.create, new_session_id(), mode, budget, system)

    async def import_session(self, data):
        return await self._call(self.service.import_session, new_session_id(), data)

    async def resume(self, sid, token):
        return await self._call(self.service.resume, sid, token)

    async def get_session(self, sid, token):
        return await self._call(self.service.get, sid, token)

    async def export_session(self, sid, token):
        return await self._call(self.service.export, sid, token)

    async def delete_session(self, sid, token):
        await self._call(self.service.delete, sid, token)

    async def cancel(self, sid, token):
        return await self._call(self.service.cancel, sid, token)

    async def list_sessions(self):
        local = await self.service.list_sessions()
        if self.service.store is None:
            return local
        held = {s["session_id"] for s in local}
        stored = [s for s in await self.service.store.summaries() if s["session_id"] not in held]
        return local + stored

    def chat(self, sid, token, content, sampling, history=None):
        return self.service.chat(sid, token, content, sampling, history)

    async def stats(self):
        return self.service.stats()
