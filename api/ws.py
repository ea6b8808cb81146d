"""The WebSocket chat protocol (see ``api.schemas`` for the events and error codes).

One connection binds at most one session at a time. The reader keeps reading while a reply
streams, so ``cancel`` works mid-turn; a second ``message`` during a turn gets ``session_busy``.
Closing the socket mid-turn cancels the turn (the partial reply stays in the history).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from api.backend import Backend
from api.errors import ApiError
from api.metrics import Metrics
from api.schemas import (
    CLIENT_EVENT_TYPES,
    Cancel,
    ErrorEvent,
    SessionCreate,
    SessionEvent,
    SessionResume,
    UserMessage,
    client_event_adapter,
)

log = logging.getLogger(__name__)


def parse_client_event(text: str):
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ApiError("invalid_json", f"the frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_json", "an event must be a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ApiError("invalid_event", "an event needs a string 'type'")
    if kind not in CLIENT_EVENT_TYPES:
        raise ApiError("unknown_type", f"unknown event type {kind!r}; one of {sorted(CLIENT_EVENT_TYPES)}")
    try:
        return client_event_adapter.validate_python(data)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'event'}: {e['msg']}" for e in exc.errors())
        raise ApiError("invalid_event", f"invalid {kind!r} event: {fields}") from None


def sampling_of(msg: UserMessage) -> dict[str, Any]:
    values = {"max_tokens": msg.max_tokens, "temperature": msg.temperature, "top_p": msg.top_p,
              "stop": msg.stop, "seed": msg.seed}
    return {k: v for k, v in values.items() if v is not None}


class ChatConnection:
    def __init__(self, ws: WebSocket, backend: Backend, metrics: Metrics):
        self.ws = ws
        self.backend = backend
        self.metrics = metrics
        self.session_id: str | None = None
        self.token: str | None = None
        self.turn: asyncio.Task | None = None
        self._canceller: asyncio.Task | None = None
        self._open_turn = False
        self._send_lock = asyncio.Lock()

    async def send(self, event: dict[str, Any]) -> None:
        self.metrics.observe(event)
        async with self._send_lock:
            await self.ws.send_text(json.dumps(event))

    async def send_error(self, code: str, message: str) -> None:
        await self.send(ErrorEvent(code=code, message=message).model_dump())

    @property
    def generating(self) -> bool:
        # Ends with the turn's last event, not with its task: the stream may still be closing.
        return self._open_turn and self.turn is not None and not self.turn.done()

    async def run(self) -> None:
        await self.ws.accept()
        try:
            while True:
                frame = await self.ws.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                text = frame.get("text")
                if text is None:
                    try:
                        text = (frame.get("bytes") or b"").decode("utf-8")
                    except UnicodeDecodeError:
                        await self.send_error("invalid_json", "frames must be UTF-8 JSON text")
                        continue
                await self.handle(text)
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away (RuntimeError: receive after close)
        finally:
            if self.turn is not None and not self.turn.done():
                self.turn.cancel()
                with contextlib.suppress(BaseException):
                    await self.turn

    async def handle(self, text: str) -> None:
        try:
            event = parse_client_event(text)
            if isinstance(event, Cancel):
                await self._cancel()
            elif self.generating:
                raise ApiError("session_busy", "a reply is being generated; wait for 'done' or send 'cancel'")
            elif isinstance(event, SessionCreate):
                await self._bind(await self.backend.create_session(event.mode, event.budget, event.system))
            elif isinstance(event, SessionResume):
                await self._bind(await self.backend.resume(event.session_id, event.token))
            elif isinstance(event, UserMessage):
                if self.session_id is None:
                    raise ApiError("no_session", "send 'session.create' or 'session.resume' first")
                self._open_turn = True
                self.turn = asyncio.get_running_loop().create_task(self._stream(event))
        except ApiError as exc:
            await self.send_error(exc.code, exc.message)
        except Exception:
            log.exception("event failed")
            await self.send_error("internal_error", "the server could not handle the event")

    async def _bind(self, info: dict[str, Any]) -> None:
        self.session_id, self.token = info["session_id"], info["token"]
        await self.send(SessionEvent(**info).model_dump())

    async def _cancel(self) -> None:
        if self.generating:
            self._canceller = asyncio.get_running_loop().create_task(self._cancel_when_started(self.turn))

    async def _cancel_when_started(self, turn: asyncio.Task) -> None:
        # The turn may not have reached its replica yet; keep asking until it stops or ends.
        for _ in range(100):
            if turn is not self.turn or not self.generating:
                return
            with contextlib.suppress(ApiError):
                if await self.backend.cancel(self.session_id, self.token):
                    return
            await asyncio.sleep(0.05)

    async def _stream(self, msg: UserMessage) -> None:
        try:
            async for event in self.backend.chat(self.session_id, self.token, msg.content, sampling_of(msg)):
                if event["type"] in ("done", "error"):
                    self._open_turn = False
                if event["type"] != "start":  # internal to the server
                    await self.send(event)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("turn of session %s failed", self.session_id)
            if self._open_turn:
                self._open_turn = False
                with contextlib.suppress(Exception):
                    await self.send_error("internal_error", "the turn failed")
        finally:
            if self.turn is asyncio.current_task():
                self._open_turn = False
