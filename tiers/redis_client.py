"""A process's one connection to Redis: redis-py's asyncio client, driven from a private event-loop thread.

The KV tier (``tiers.redis_tier``) uses it from the model thread and the page reader and blocks on each
call (``run``); the session records (``app.session_store``) await it from the service's event loop
(``call``). Both go through the same client and connection pool, on the one loop that owns them, so a
process holds one set of connections whichever layer speaks.

Every call passes the client's circuit breaker (``tiers.breaker``): once Redis failed to answer, calls
fail at once with ``RedisUnavailable`` until a probe finds it back, so a Redis that does not answer
costs one timeout, not one per call. Every outcome updates ``healthy`` and ``last_error``; ``check``
answers ``/healthz`` within a bounded wait whatever Redis does.

The URL may name a Redis Cluster (``tiers.redis_url``): redis-py's cluster client then routes each
command by its key's slot. Every session's keys share one slot (``tiers.keys``), so a call on one
session, pipelines included, goes to one shard. A call that names its key (``run``/``call``'s ``key``)
passes that shard's own circuit: a dead shard opens its circuit alone, and the sessions on the live
shards go on. Keyless calls (pings) pass the client's circuit.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tiers.breaker import CircuitBreaker
from tiers.redis_url import is_cluster, parse_cluster

T = TypeVar("T")
# What says Redis is unreachable (as opposed to answering with an error, which it then is not). On a
# cluster: a shard that refuses to serve (CLUSTERDOWN, MASTERDOWN), a slot no known node serves, and no
# node reachable at all (a newer redis-py's own error for it; a connection error in older ones).
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, TimeoutError,
               redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError,
               getattr(redis.exceptions, "RedisClusterUnreachableError", redis.exceptions.ConnectionError))


class RedisUnavailable(redis.exceptions.ConnectionError):
    """A call not sent: Redis failed to answer lately and the circuit is open until its next probe."""


def connect(url: str, timeout_s: float) -> aioredis.Redis | RedisCluster:
    """An asyncio client of the Redis or the Redis Cluster ``url`` names; bytes in and out (tensors are raw
    bytes, and JSON decodes from bytes as well)."""
    common = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s, "decode_responses": False}
    if not is_cluster(url):
        return aioredis.Redis.from_url(url, **common)
    parsed = parse_cluster(url)
    # One retry, at once, on the layout refreshed after the error: a moved slot or a failover's new
    # primary is found; a dead shard fails fast into its circuit instead of backing off for seconds.
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in parsed.nodes],
                        username=parsed.username, password=parsed.password, ssl=parsed.ssl,
                        retry=Retry(NoBackoff(), 1), **common)


class RedisClient:
    def __init__(self, url: str, timeout_s: float = 2.0, retry_s: float = 1.0):
        """``timeout_s``: per socket operation; ``retry_s``: how long calls fail at once after a failure
        before one probes again (doubling while probes fail, up to 30 times that)."""
        self.url = url
        self.timeout_s = timeout_s  # per socket operation; a blocking ``run`` waits three times this at most
        self.healthy = True
        self.last_error: str | None = None
        self.cluster = is_cluster(url)
        self.breaker = CircuitBreaker(retry_s, 30 * retry_s)  # keyless calls; every call on one Redis
        self._shards: dict[str, CircuitBreaker] = {}  # a cluster's: one per primary ("host:port"), made on first use
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rkv-redis", daemon=True)
        self._thread.start()
        self._check_lock = threading.Lock()
        self._check: concurrent.futures.Future | None = None  # the health ping in flight, if any
        self.redis = connect(url, timeout_s)
        if self.cluster:
            # Read the cluster's layout and command table now, while it may be whole: redis-py reads the
            # table from the primary of the first slot range and cannot start while that one is down.
            asyncio.run_coroutine_threadsafe(self._quietly(self.redis.initialize()), self._loop)

    @staticmethod
    async def _quietly(coro: Coroutine[Any, Any, Any]) -> None:
        try:
            await coro
        except Exception:  # noqa: BLE001 - not started now: the first call starts it, through its circuit
            pass

    def _shard(self, key: str) -> str | None:
        """The name of the primary serving ``key``'s slot; None before the layout is known."""
        try:
            return self.redis.get_node_from_key(key).name
        except Exception:  # noqa: BLE001 - no call has answered yet: the layout is not read
            return None

    def breaker_of(self, key: str | None) -> CircuitBreaker:
        """The circuit a call on ``key`` passes: its shard's on a cluster, else the client's."""
        shard = self._shard(key) if key is not None and self.cluster else None
        if shard is None:
            return self.breaker
        found = self._shards.get(shard)
        if found is None:
            found = self._shards.setdefault(shard, CircuitBreaker(self.breaker.first_s, self.breaker.most_s))
        return found

    async def _tracked(self, coro: Coroutine[Any, Any, T], breaker: CircuitBreaker) -> T:
        answered = False
        try:
            result = await coro
            answered = True
        except UNREACHABLE as exc:
            self.failed(exc, breaker)
            raise
        except Exception as exc:  # Redis answered, with an error: it is reachable
            self.last_error = f"{type(exc).__name__}: {exc}"
            answered = True
            raise
        finally:
            if answered:
                self.healthy = True
                breaker.succeeded()
            else:
                breaker.abandoned()  # cancelled without an answer: a probe must not stay out
        return result

    def failed(self, exc: BaseException, breaker: CircuitBreaker | None = None) -> None:
        self.healthy = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        (breaker or self.breaker).failed()

    def _admit(self, coro: Coroutine[Any, Any, Any], breaker: CircuitBreaker) -> None:
        if not breaker.admit():
            coro.close()  # never sent
            raise RedisUnavailable(
                f"Redis failed lately ({self.last_error}); calls fail at once for {breaker.retry_in():.1f} s more"
            )

    def unavailable(self, key: str | None = None) -> bool:
        """Whether a call on ``key`` now would fail at once (its circuit is open and no probe is due). No key
        on a cluster: whether every shard known so far would (nowhere to spill to)."""
        if key is None and self.cluster and self._shards:
            return all(b.blocked() for b in list(self._shards.values()))
        return self.breaker_of(key).blocked()

    def circuit(self) -> dict[str, int]:
        """``/metrics`` figures over all of this client's circuits: open when any one is (a shard is out)."""
        figures = [b.as_dict() for b in [self.breaker, *list(self._shards.values())]]
        return {name: (max if name == "redis_circuit_open" else sum)(f[name] for f in figures) for name in figures[0]}

    def run(self, coro: Coroutine[Any, Any, T], key: str | None = None) -> T:
        """Run ``coro`` (made from ``self.redis``; its keys in ``key``'s slot) on the client's loop and wait
        for it; raises its error, or ``RedisUnavailable`` at once while its circuit is open."""
        breaker = self.breaker_of(key)
        self._admit(coro, breaker)
        fut = asyncio.run_coroutine_threadsafe(self._tracked(coro, breaker), self._loop)
        try:
            return fut.result(self.timeout_s * 3)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            self.failed(exc, breaker)
            raise

    async def call(self, coro: Coroutine[Any, Any, T], key: str | None = None) -> T:
        """Await ``coro`` (made from ``self.redis``; its keys in ``key``'s slot) from any other event loop;
        raises its error, or ``RedisUnavailable`` at once while its circuit is open."""
        breaker = self.breaker_of(key)
        self._admit(coro, breaker)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._tracked(coro, breaker), self._loop))

    async def per_shard(self, keys: list[str], add: Callable[[Any, str], Any]) -> list[Any]:
        """Reads across sessions (a listing), from any other event loop: one pipeline per shard, the shards
        at once, ``add(pipe, key)`` queuing each key's command; the replies in key order. On a cluster a
        shard that cannot answer gives its error in place of each of its keys' replies, and the others
        answer; on one Redis the error is raised."""
        groups: dict[str | None, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._shard(key) if self.cluster else None, []).append(i)

        async def read(idx: list[int]) -> list[Any]:
            async def op():
                async with self.redis.pipeline(transaction=False) as pipe:
                    for i in idx:
                        add(pipe, keys[i])
                    return await pipe.execute()

            return await self.call(op(), key=keys[idx[0]])

        replies = await asyncio.gather(*(read(idx) for idx in groups.values()), return_exceptions=self.cluster)
        out: list[Any] = [None] * len(keys)
        for idx, reply in zip(groups.values(), replies):
            for j, i in enumerate(idx):
                out[i] = reply if isinstance(reply, BaseException) else reply[j]
        return out

    def ping(self) -> bool:
        """Whether Redis answers now (and so clears ``healthy`` or sets it)."""
        try:
            return bool(self.run(self.redis.ping()))  # keyless: any node of a cluster
        except Exception:  # noqa: BLE001 - the answer is "no"; ``last_error`` says why
            return False

    async def check(self, wait_s: float) -> str | None:
        """For ``/healthz``, from any event loop: None when Redis answers a ping within ``wait_s``, else why
        not. An open circuit answers at once. The ping goes out whatever the circuit says and its answer
        closes or opens it (a health check is a probe); one is out at a time, and one that outlives the
        wait goes on. A cluster answers when every primary does: a shard out is a degraded store."""
        with self._check_lock:
            if self._check is None or self._check.done():
                probe = self.redis.ping(target_nodes=RedisCluster.PRIMARIES) if self.cluster else self.redis.ping()
                self._check = asyncio.run_coroutine_threadsafe(self._tracked(probe, self.breaker), self._loop)
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
