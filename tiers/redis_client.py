"""A process's one connection to Redis: redis-py's asyncio client, driven from a private event-loop thread.

The KV tier (``tiers.redis_tier``) uses it from the model thread and the page reader and blocks on each
call (``run``); the session records (``app.session_store``) await it from the service's event loop
(``call``). Both go through the same client and connection pool, on the one loop that owns them, so a
process holds one set of connections whichever layer speaks.

Every call passes the client's circuit breaker (``tiers.breaker``): once Redis failed to answer, calls
fail at once with ``RedisUnavailable`` until a probe finds it back, so a Redis that does not answer
costs one timeout, not one per call. Every outcome updates ``healthy`` and ``last_error``; ``check``
answers ``/healthz`` within a bounded wait whatever Redis does.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from tiers.breaker import CircuitBreaker

T = TypeVar("T")
# What says Redis is unreachable (as opposed to answering with an error, which it then is not).
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, TimeoutError)


class RedisUnavailable(redis.exceptions.ConnectionError):
    """A call not sent: Redis failed to answer lately and the circuit is open until its next probe."""


class RedisClient:
    def __init__(self, url: str, timeout_s: float = 2.0, retry_s: float = 1.0):
        """``timeout_s``: per socket operation; ``retry_s``: how long calls fail at once after a failure
        before one probes again (doubling while probes fail, up to 30 times that)."""
        self.url = url
        self.timeout_s = timeout_s  # per socket operation; a blocking ``run`` waits three times this at most
        self.healthy = True
        self.last_error: str | None = None
        self.breaker = CircuitBreaker(retry_s, 30 * retry_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rkv-redis", daemon=True)
        self._thread.start()
        self._check_lock = threading.Lock()
        self._check: concurrent.futures.Future | None = None  # the health ping in flight, if any
        # Bytes in and out: tensors are raw bytes, and JSON decodes from bytes as well.
        self.redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, decode_responses=False
        )

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        answered = False
        try:
            result = await coro
            answered = True
        except UNREACHABLE as exc:
            self.failed(exc)
            raise
        except Exception as exc:  # Redis answered, with an error: it is reachable
            self.last_error = f"{type(exc).__name__}: {exc}"
            answered = True
            raise
        finally:
            if answered:
                self.healthy = True
                self.breaker.succeeded()
            else:
                self.breaker.abandoned()  # cancelled without an answer: a probe must not stay out
        return result

    def failed(self, exc: BaseException) -> None:
        self.healthy = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.breaker.failed()

    def _admit(self, coro: Coroutine[Any, Any, Any]) -> None:
        if not self.breaker.admit():
            coro.close()  # never sent
            raise RedisUnavailable(
                f"Redis failed lately ({self.last_error}); calls fail at once for {self.breaker.retry_in():.1f} s more"
            )

    def unavailable(self) -> bool:
        """Whether a call now would fail at once (the circuit is open and no probe is due)."""
        return self.breaker.blocked()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` (made from ``self.redis``) on the client's loop and wait for it; raises its error,
        or ``RedisUnavailable`` at once while the circuit is open."""
        self._admit(coro)
        fut = asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)
        try:
            return fut.result(self.timeout_s * 3)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            self.failed(exc)
            raise

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (made from ``self.redis``) from any other event loop; raises its error, or
        ``RedisUnavailable`` at once while the circuit is open."""
        self._admit(coro)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop))

    def ping(self) -> bool:
        """Whether Redis answers now (and so clears ``healthy`` or sets it)."""
        try:
            return bool(self.run(self.redis.ping()))
        except Exception:  # noqa: BLE001 - the answer is "no"; ``last_error`` says why
            return False

    async def check(self, wait_s: float) -> str | None:
        """For ``/healthz``, from any event loop: None when Redis answers a ping within ``wait_s``, else why
        not. An open circuit answers at once. The ping goes out whatever the circuit says and its answer
        closes or opens it (a health check is a probe); one is out at a time, and one that outlives the
        wait goes on."""
        with self._check_lock:
            if self._check is None or self._check.done():
                self._check = asyncio.run_coroutine_threadsafe(self._tracked(self.redis.ping()), self._loop)
            ping = self._check
        if self.breaker.is_open():
            return self.last_error or "Redis failed lately"
        waiting = asyncio.wrap_future(ping)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, so never logged as lost
        try:
            await asyncio.wait_for(asyncio.shield(waiting), wait_s)
        except asyncio.TimeoutError:
            return f"Redis did not answer within {wait_s:g} s"
        except Exception:  # noqa: BLE001 - the answer is "no"; ``last_error`` says why
            return self.last_error or "Redis did not answer"
        return None

    def close(self) -> None:
        if not self._loop.is_running():  # closed already (a service closes its engine, and so may its owner)
            return
        try:  # not through the breaker: closing sends nothing
            asyncio.run_coroutine_threadsafe(self.redis.aclose(), self._loop).result(self.timeout_s * 3)
        except Exception:  # noqa: BLE001 - closing a connection that is already gone
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
