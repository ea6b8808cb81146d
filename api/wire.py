"""The service's turn events (``app.contract.events``) in the WebSocket / stream wire format.

One conversion for every backend: each event's plain-data form is validated into its
``api.schemas`` model, so what leaves the server is exactly what the schemas document. ``start``
is not a wire event: it stays a plain dict that the protocol handlers read and never send.
"""
from __future__ import annotations

from typing import Any

from api.schemas import server_event_adapter
from app.contract.events import TurnEvent, TurnStarted


def wire_event(event: TurnEvent) -> dict[str, Any]:
    data = event.as_dict()
    if event.type == TurnStarted.type:
        return data
    return server_event_adapter.validate_python(data).model_dump()
