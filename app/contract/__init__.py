"""What the chat service promises whoever calls it: session ids, turn events, error codes, and the
service's interface itself (``app.contract.service.SessionService``).

This is the seam between ``app`` (service, engine) and ``api`` (HTTP, WebSocket, OpenAI, Ray):
the service yields the events and raises the errors defined here, as plain data that can cross a
process boundary; ``api`` turns them into its wire formats (``api.wire``, ``api.errors``). Nothing
here knows about HTTP, JSON schemas or Ray.
"""
from app.contract.errors import ChatError
from app.contract.events import (
    Delta,
    Done,
    MapSummary,
    MemoryStats,
    Status,
    TurnEvent,
    TurnFailed,
    TurnStarted,
    Usage,
)
from app.contract.ids import is_session_id, new_session_id, new_session_token, new_turn_key

__all__ = [
    "ChatError",
    "Delta",
    "Done",
    "MapSummary",
    "MemoryStats",
    "Status",
    "TurnEvent",
    "TurnFailed",
    "TurnStarted",
    "Usage",
    "is_session_id",
    "new_session_id",
    "new_session_token",
    "new_turn_key",
]
