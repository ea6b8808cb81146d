"""The service's turn events (``app.contract.events``) in the WebSocket / stream wire format.

One conversion for every transport: each event's plain-data form is validated into its
``api.schemas`` model, so what leaves the server is exactly what the schemas document. ``start``
is not a wire event: it stays a plain dict that the protocol handlers read and never send.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from api.schemas import server_event_adapter
from app.contract.events import TurnEvent, TurnStarted


def wire_event(event: TurnEvent) -> dict[str, Any]:
    data = event.as_dict()
    if event.type == TurnStarted.type:
        return data
    return server_event_adapter.validate_python(data).model_dump()


async def wire_stream(events: AsyncIterator[TurnEvent]) -> AsyncIterator[dict[str, Any]]:
    """A turn's events in wire format; closing this closes the turn (it ends as cancelled)."""
    async with contextlib.aclosing(events):
        async for event in events:
            yield wire_event(event)
