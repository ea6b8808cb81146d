"""The session service as its callers see it: one interface, whatever runs the sessions.

``SessionService`` is what the HTTP, WebSocket and OpenAI layers are given (``api.routes``). One
class implements it, ``api.service_client.ServiceClient``, over a chat replica's ``ChatService`` in
this process or over Ray Serve replicas. A replica's service has the same verbs (``VERBS``, plus
``chat``), under the same names, with the session id first where the caller chooses it (the
router keys on it before any replica is involved).

A verb's result crosses a process boundary as data, ``{"ok": value}`` or ``{"error": {code,
message}}``: ``outcome`` makes it on the replica's side, ``unwrap`` reads it on the caller's. Turns
stream the events of ``app.contract.events`` and report failures as a ``TurnFailed`` event.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

from app.contract.errors import ChatError
from app.contract.events import TurnEvent

# The unary verbs of a replica's service; ``chat`` streams.
VERBS = (
    "create_session",
    "import_session",
    "resume_session",
    "get_session",
    "export_session",
    "memory_map",
    "delete_session",
    "cancel_turn",
    "list_sessions",
    "stats",
    "health",
)
# Verbs after which the replica holds the session (the Ray router then prefers it).
HOLDING_VERBS = ("create_session", "import_session", "resume_session", "get_session", "export_session", "memory_map")


class SessionService(Protocol):
    kind: str  # "local" or "ray", for /healthz
    replica: str  # who answers requests that no session replica handled
    model_name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def create_session(
        self, mode: str | None, budget: int | None, system: str | None, owner: str | None = None
    ) -> dict[str, Any]: ...

    async def import_session(self, data: dict[str, Any], owner: str | None = None) -> dict[str, Any]: ...

    async def resume_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]: ...

    async def get_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]: ...

    async def export_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any]: ...

    async def memory_map(
        self, sid: str, token: str | None, owner: str | None = None, text: bool = False
    ) -> dict[str, Any]:
        """Where each of the session's tokens is, per layer and KV head (``app.session_map``)."""
        ...

    async def delete_session(self, sid: str, token: str | None, owner: str | None = None) -> dict[str, Any] | None:
        """Delete for good; what the delete's write promises (``Saved`` as a dict), None without a store."""

    async def cancel_turn(self, sid: str, token: str | None, owner: str | None = None) -> bool: ...

    async def list_sessions(self, owner: str | None = None) -> list[dict[str, Any]]: ...

    def chat(
        self,
        sid: str,
        token: str | None,
        content: str,
        sampling: dict[str, Any],
        history: list[list[str]] | None = None,
        owner: str | None = None,
        turn_key: str | None = None,
    ) -> AsyncIterator[TurnEvent]:
        """One turn's events. ``turn_key`` is its idempotency key (made by the client class when the
        caller gives none): every attempt of one request carries the same one, so the turn runs once."""
        ...

    async def stats(self) -> dict[str, Any]:
        """Totals over all replicas: sessions, device/host/redis bytes, promotions, demotions."""
        ...

    async def health(self) -> dict[str, Any]:
        """``{"redis": {"ok", "error"}, "unsaved_sessions"}`` where Redis is configured; ``{}`` without it."""
        ...


async def outcome(call: Awaitable[Any]) -> dict[str, Any]:
    """A verb's result or error as data that crosses a process boundary."""
    try:
        return {"ok": await call}
    except ChatError as exc:
        return {"error": {"code": exc.code, "message": exc.message}}


def unwrap(result: dict[str, Any]) -> Any:
    """The value of ``outcome``'s data, or its error raised again as the same class."""
    if "error" in result:
        raise ChatError.from_code(result["error"]["code"], result["error"]["message"])
    return result["ok"]
