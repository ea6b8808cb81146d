"""Request-size and frame-rate limits of the HTTP and WebSocket layers.

The engine enforces the per-turn limits (message bytes, history tokens, max_tokens) and the
chat service the sessions per replica; what is here guards the server before any of that runs:
a body too large to be a valid request, and a WebSocket client sending frames faster than a
person (or a sane program) would.
"""
from __future__ import annotations

import time

from api.auth import refuse
from api.errors import ApiError


class BodyLimit:
    """Pure ASGI middleware: a request body over ``max_bytes`` gets 413 ``request_too_large``.

    A declared ``content-length`` is refused before reading; a chunked body is read up to the
    limit and then handed to the app as one message.
    """

    def __init__(self, app, max_bytes: int, metrics=None):
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def _too_large(self, send) -> None:
        exc = ApiError("request_too_large", f"the request body is over {self.max_bytes} bytes")
        if self.metrics is not None:
            self.metrics.error(exc.code)
        await refuse(send, 413, exc)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for key, value in scope.get("headers", []):
            if key.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.max_bytes + 1
                if declared > self.max_bytes:
                    return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)


class FrameRate:
    """Token bucket: ``rate`` frames per second sustained, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate = rate
        self.burst = float(burst)
        self.clock = clock
        self.tokens = float(burst)
        self.at = clock()

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
