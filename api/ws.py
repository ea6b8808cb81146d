"""The WebSocket chat protocol (see ``api.schemas`` for the events and error codes).

One connection binds at most one session at a time. The reader keeps reading while a reply
streams, so ``cancel`` works mid-turn; a second ``message`` during a turn gets ``session_busy``,
and a ``cancel`` with no turn under way gets ``no_active_turn``: every client event is answered.
Closing the socket mid-turn cancels the turn (the partial reply stays in the history).

With API keys configured the connection is authenticated once: by the handshake's
``Authorization: Bearer`` header or ``?api_key=`` query parameter (browsers cannot set headers on
a WebSocket), or else by an ``auth`` frame that must come first, within ``ws_auth_timeout_s``.
A missing or wrong key gets an ``unauthorized`` error and the close code ``CLOSE_UNAUTHORIZED``.
Frames over the connection's rate are dropped, each answered ``rate_limited``; the connection
stays open (a client that floods without reading is slowed by its own full socket buffer).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from api.auth import ApiKeys, bearer, header
from api.errors import ApiError
from api.limits import FrameRate
from api.metrics import Metrics
from api.schemas import (
    CLIENT_EVENT_TYPES,
    Auth,
    AuthenticatedEvent,
    Cancel,
    ErrorEvent,
    SessionCreate,
    SessionEvent,
    SessionResume,
    UserMessage,
    client_event_adapter,
)
from api.wire import wire_stream
from app.contract.errors import ChatError
from app.contract.service import SessionService
from app.settings import ServeSettings

log = logging.getLogger(__name__)
CLOSE_UNAUTHORIZED = 4401  # private-use range (4000-4999); the browser UI knows it


def parse_client_event(text: str):
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ApiError("invalid_json", f"the frame is not valid JSON: {exc}") from None
    except RecursionError:  # a RuntimeError: uncaught, it would pass for a client that went away
        raise ApiError("invalid_json", "the frame nests too deeply") from None
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
    return {**msg.sampling(), **({"stop": msg.stop} if msg.stop is not None else {})}


class ChatConnection:
    def __init__(
        self,
        ws: WebSocket,
        service: SessionService,
        metrics: Metrics,
        keys: ApiKeys | None = None,
        settings: ServeSettings | None = None,
    ):
        settings = settings or ServeSettings()
        self.ws = ws
        self.service = service
        self.metrics = metrics
        self.keys = keys or ApiKeys(None)
        self.owner: str | None = None
        self.authenticated = not self.keys.enabled
        self.rate = FrameRate(settings.ws_frames_per_s, settings.ws_frame_burst)
        self.max_frame_bytes = settings.max_request_bytes
        self.auth_timeout_s = settings.ws_auth_timeout_s
        self.session_id: str | None = None
        self.token: str | None = None
        self.turn: asyncio.Task | None = None
        self._canceller: asyncio.Task | None = None
        self._open_turn = False
        self._closed = False
        self._send_lock = asyncio.Lock()

    async def send(self, event: dict[str, Any]) -> None:
        self.metrics.observe(event)
        async with self._send_lock:
            await self.ws.send_text(json.dumps(event))

    async def send_error(self, code: str, message: str) -> None:
        await self.send(ErrorEvent(code=code, message=message).model_dump())

    async def refuse(self, message: str) -> None:
        """``unauthorized``, then close: nothing else is said to a client without a valid key."""
        with contextlib.suppress(Exception):
            await self.send_error("unauthorized", message)
            await self.ws.close(code=CLOSE_UNAUTHORIZED, reason="unauthorized")
        self._closed = True

    @property
    def generating(self) -> bool:
        # Ends with the turn's last event, not with its task: the stream may still be closing.
        return self._open_turn and self.turn is not None and not self.turn.done()

    async def _handshake_auth(self) -> None:
        """Authenticate from the handshake when it carries a key; otherwise wait for an ``auth`` frame."""
        if self.authenticated:
            return
        scope = self.ws.scope
        key = bearer(header(scope, b"authorization")) or self.ws.query_params.get("api_key")
        if key is None:
            return
        try:
            self.owner = self.keys.owner(key)
            self.authenticated = True
        except ApiError as exc:
            await self.refuse(exc.message)

    async def _receive(self) -> dict:
        if self.authenticated:
            return await self.ws.receive()
        try:
            return await asyncio.wait_for(self.ws.receive(), self.auth_timeout_s)
        except asyncio.TimeoutError:
            await self.refuse(f"send {{'type': 'auth', 'api_key': ...}} first (within {self.auth_timeout_s:g} s)")
            return {"type": "websocket.disconnect"}

    async def run(self) -> None:
        await self.ws.accept()
        try:
            await self._handshake_auth()
            while not self._closed:
                frame = await self._receive()
                if frame["type"] == "websocket.disconnect":
                    break
                if not self.rate.allow():
                    await self.send_error("rate_limited", "too many frames; this one was dropped, slow down")
                    continue
                text, data = frame.get("text"), frame.get("bytes") or b""
                size = len(data) if text is None else len(text.encode("utf-8", "surrogatepass"))
                if size > self.max_frame_bytes:
                    await self.send_error("message_too_large", f"frames are limited to {self.max_frame_bytes} bytes")
                    continue
                if text is None:  # a binary frame: accepted when it is UTF-8 JSON
                    try:
                        text = data.decode("utf-8")
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
        except ApiError as exc:
            if not self.authenticated:
                return await self.refuse("the first frame must be {'type': 'auth', 'api_key': ...}")
            return await self.send_error(exc.code, exc.message)
        if not self.authenticated and not isinstance(event, Auth):
            return await self.refuse("the first frame must be {'type': 'auth', 'api_key': ...}")
        try:
            if isinstance(event, Auth):
                await self._auth(event)
            elif isinstance(event, Cancel):
                await self._cancel()
            elif self.generating:
                raise ApiError("session_busy", "a reply is being generated; wait for 'done' or send 'cancel'")
            elif isinstance(event, SessionCreate):
                info = await self.service.create_session(event.mode, event.budget, event.system, self.owner)
                await self._bind(info)
            elif isinstance(event, SessionResume):
                await self._bind(await self.service.resume_session(event.session_id, event.token, self.owner))
            elif isinstance(event, UserMessage):
                if self.session_id is None:
                    raise ApiError("no_session", "send 'session.create' or 'session.resume' first")
                self._open_turn = True
                self.turn = asyncio.get_running_loop().create_task(self._stream(event))
        except ChatError as exc:
            await self.send_error(exc.code, exc.message)
        except Exception:
            log.exception("event failed")
            await self.send_error("internal_error", "the server could not handle the event")

    async def _auth(self, event: Auth) -> None:
        try:
            owner = self.keys.owner(event.api_key)
        except ApiError as exc:
            return await self.refuse(exc.message)
        if self.authenticated and owner != self.owner:
            raise ApiError("invalid_event", "this connection is already authenticated with another key")
        self.owner, self.authenticated = owner, True
        await self.send(AuthenticatedEvent().model_dump())

    async def _bind(self, info: dict[str, Any]) -> None:
        self.session_id, self.token = info["session_id"], info["token"]
        await self.send(SessionEvent(**info).model_dump())

    async def _cancel(self) -> None:
        """Stop the turn under way; its ``done`` (``finish_reason: cancelled``) is the answer.
        With no turn under way the answer is ``no_active_turn``: every client event gets one."""
        if not self.generating:
            raise ApiError("no_active_turn", "no reply is being generated on this connection; nothing to cancel")
        self._canceller = asyncio.get_running_loop().create_task(self._cancel_when_started(self.turn))

    async def _cancel_when_started(self, turn: asyncio.Task) -> None:
        # The turn may not have reached its replica yet; keep asking until it stops or ends.
        for _ in range(100):
            if turn is not self.turn or not self.generating:
                return
            with contextlib.suppress(ChatError):
                if await self.service.cancel_turn(self.session_id, self.token, self.owner):
                    return
            await asyncio.sleep(0.05)

    async def _stream(self, msg: UserMessage) -> None:
        events = wire_stream(self.service.chat(self.session_id, self.token, msg.content, sampling_of(msg),
                                               owner=self.owner, turn_key=msg.idempotency_key))
        try:
            # aclosing: a send that fails (client gone) must end the turn now, not when the
            # abandoned generator happens to be collected.
            async with contextlib.aclosing(events):
                async for event in events:
                    if event["type"] in ("done", "error"):
                        self._open_turn = False
                    if event["type"] != "start":  # internal to the server
                        await self.send(event)
        except asyncio.CancelledError:
            raise
        except WebSocketDisconnect:
            pass  # the reader sees the disconnect too; the turn was closed as cancelled
        except Exception:
            log.exception("turn of session %s failed", self.session_id)
            if self._open_turn:
                self._open_turn = False
                with contextlib.suppress(Exception):
                    await self.send_error("internal_error", "the turn failed")
        finally:
            if self.turn is asyncio.current_task():
                self._open_turn = False
