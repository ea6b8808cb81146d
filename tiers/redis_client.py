"""A process's one connection to Redis: redis-py's asyncio client, driven from a private event-loop thread.

The KV tier (``tiers.redis_tier``) uses it from the model thread and blocks on each call (``run``);
the session records (``app.session_store``) await it from the service's event loop (``call``). Both
go through the same client and connection pool, on the one loop that owns them, so a process holds
one set of connections whichever layer speaks. Every outcome updates ``healthy`` and ``last_error``,
which ``/healthz`` reports.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")


class RedisClient:
    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url
        self.timeout_s = timeout_s  # per socket operation; a blocking ``run`` waits three times this at most
        self.healthy = True
        self.last_error: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rkv-redis", daemon=True)
        self._thread.start()
        # Bytes in and out: tensors are raw bytes, and JSON decodes from bytes as well.
        self.redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, decode_responses=False
        )

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            result = await coro
        except Exception as exc:
            self.failed(exc)
            raise
        self.healthy = True
        return result

    def failed(self, exc: BaseException) -> None:
        self.healthy = False
        self.last_error = f"{type(exc).__name__}: {exc}"

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` (made from ``self.redis``) on the client's loop and wait for it; raises its error."""
        fut = asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)
        try:
            return fut.result(self.timeout_s * 3)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            self.failed(exc)
            raise

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (made from ``self.redis``) from any other event loop; raises its error."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop))

    def ping(self) -> bool:
        """Whether Redis answers now (and so clears ``healthy`` or sets it)."""
        try:
            return bool(self.run(self.redis.ping()))
        except Exception:  # noqa: BLE001 - the answer is "no"; ``last_error`` says why
            return False

    def close(self) -> None:
        try:
            self.run(self.redis.aclose())
        except Exception:  # noqa: BLE001 - closing a connection that is already gone
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
