"""A process's one connection to Redis: redis-py's asyncio client, driven from a private event-loop thread.
The page store blocks on each call from the model thread and the page reader (``run``); the session
records await it from the service's loop (``call``): one set of connections, whichever layer speaks.
Every call passes a circuit breaker (``tiers.store.redis.breaker``): after a failure, calls fail at once
with ``RedisUnavailable`` until a probe finds Redis back.

The URL may name a Sentinel set (the client asks the sentinels for the primary and follows a failover)
or a Redis Cluster (commands routed by their key's slot). Every session's keys share one slot, so a call
on one session goes to one shard, through that shard's own circuit: a dead shard opens its circuit
alone, and the sessions on the live shards go on. Keyless calls (pings) pass the client's circuit.
"""
from __future__ import annotations

import asyncio
import contextlib
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from tiers.store.redis.breaker import CircuitBreaker
from tiers.store.redis.url import is_cluster, is_sentinel, parse_cluster, parse_sentinel

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
    """An asyncio client of the Redis, the Sentinel set's primary or the Redis Cluster ``url`` names; bytes
    in and out (tensors are raw bytes, and JSON decodes from bytes as well)."""
    common = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s, "decode_responses": False}
    if is_sentinel(url):
        parsed = parse_sentinel(url)
        auth = {"username": parsed.username, "password": parsed.password, "ssl": parsed.ssl}
        sentinels = Sentinel(list(parsed.nodes), sentinel_kwargs={**common, **auth}, **common)
        # The pool asks the sentinels for the primary at every new connection and drops its connections
        # when one answers as a replica (a failover happened): calls after a failover reach the new primary.
        return sentinels.master_for(parsed.service, db=parsed.db, **auth, **common)
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
        """``retry_s``: how long calls fail at once after a failure, until a probe (doubling as probes fail, to 30x)."""
        self.url = url
        self.timeout_s = timeout_s  # per socket operation; a blocking ``run`` waits three times this at most
        self.healthy = True
        self.last_error: str | None = None
        self.cluster = is_cluster(url)
        self.calls = 0  # round trips sent (a pipeline is one)
        self.reconnects = 0  # calls answered with their circuit open: Redis is back (its config is read again)
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
        with contextlib.suppress(Exception):  # not started now: the first call starts it, through its circuit
            await coro

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
        answered, was_open = False, breaker.is_open()
        self.calls += 1
        try:
            result = await coro
            answered = True
        except UNREACHABLE as exc:
            self.failed(exc, breaker)
            raise
        except redis.exceptions.ReadOnlyError as exc:
            # A primary demoted behind a fixed address (a managed failover moving its name or VIP): its
            # connections are dropped, so the next ones reach whichever node is primary now.
            if not self.cluster:
                await self.redis.connection_pool.disconnect()
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
                self.reconnects += was_open
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
            raise RedisUnavailable(f"Redis failed lately ({self.last_error}); "
                                   f"calls fail at once for {breaker.retry_in():.1f} s more")

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
        """``run``, awaited from any other event loop."""
        breaker = self.breaker_of(key)
        self._admit(coro, breaker)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._tracked(coro, breaker), self._loop))

    async def per_shard(self, keys: list[str], add: Callable[[Any, str], Any]) -> list[Any]:
        """Reads across sessions (a listing), from any other event loop: one pipeline per shard, all at once,
        ``add(pipe, key)`` queuing each key's command; the replies in key order. A cluster's shard that
        cannot answer gives its error as each of its keys' reply; on one Redis the error is raised."""
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

    async def _aclose(self) -> None:
        await self.redis.aclose()
        pool = getattr(self.redis, "connection_pool", None)  # a cluster client has none
        manager = getattr(pool, "sentinel_manager", None)  # a Sentinel set's own clients
        for sentinel in getattr(manager, "sentinels", ()):
            await sentinel.aclose()

    def close(self) -> None:
        if not self._loop.is_running():  # closed already (a service closes its engine, and so may its owner)
            return
        with contextlib.suppress(Exception):  # not through the breaker; a connection already gone is closed
            asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(self.timeout_s * 3)
        self._loop.call_soon_threadsafe(self._loop.stop)
