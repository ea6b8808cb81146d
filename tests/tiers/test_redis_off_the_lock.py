"""A Redis that hangs costs the host tier one timeout, never its lock; counters read while pages go in.

The hanging Redis is a socket that accepts connections and never answers (``serving_helpers.BlackHole``);
the counters are read against the suite's real Redis.
"""
import threading
import time

import pytest
import redis
import torch
from serving_helpers import BlackHole

from tiers.host.tier import HostFull, HostTier
from tiers.store.redis.breaker import CircuitBreaker
from tiers.store.redis.client import RedisClient, RedisUnavailable
from tiers.store.redis.keys import kv_key
from tiers.store.redis.pages import RedisPageStore
from tiers.store.wire import pack

TIMEOUT_S = 1.0


def page(seed: int, n: int = 1, p: int = 16, d: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(n, p, d, generator=g), "values": torch.randn(n, p, d, generator=g)}


PAGE_BYTES = 2 * 16 * 8 * 4


def test_ten_demotions_into_a_full_host_tier_cost_one_redis_timeout_and_never_hold_its_lock():
    with BlackHole() as hole:
        store = RedisPageStore(RedisClient(hole.url, timeout_s=TIMEOUT_S), namespace="rkvtest-hole")
        host = HostTier(capacity_bytes=2 * PAGE_BYTES, store=store)
        try:
            host.put_many("s", ["c/0", "c/1"], page(0, 2))
            outcomes = []

            def demote(i: int) -> None:
                try:
                    host.put_many("s", [f"d/{i}"], page(i))
                    outcomes.append("stored")
                except HostFull:
                    outcomes.append("refused")

            start = time.monotonic()
            first = threading.Thread(target=demote, args=(0,))
            first.start()
            time.sleep(0.3)  # the first demotion's spill now waits on Redis
            assert first.is_alive()
            t = time.monotonic()
            got, _ = host.read_many("s", ["c/0", "c/1"])  # a page being spilled is still read from its slot
            assert host.where_many("s", ["c/1"]) == ["host"] and host.session_bytes("s") == 2 * PAGE_BYTES
            assert time.monotonic() - t < 0.2, "the host tier's lock was held across a Redis call"
            first.join()
            for i in range(1, 10):
                demote(i)
            elapsed = time.monotonic() - start
            assert outcomes == ["refused"] * 10
            # One timeout (the first spill), then the open circuit refuses at once.
            assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S * 1.6, elapsed
            assert store.client.breaker.opened == 1 and store.unavailable()
            assert host.stats.bytes == 2 * PAGE_BYTES and host.exhausted == 10
            assert torch.equal(got["keys"], page(0, 2)["keys"])
            again, _ = host.read_many("s", ["c/0", "c/1"])  # nothing was lost on the way
            assert torch.equal(again["values"], page(0, 2)["values"])
        finally:
            store.close()


def test_the_circuit_fails_calls_at_once_then_probes_and_closes_when_redis_answers(redis_url):
    client = RedisClient(redis_url, timeout_s=0.5, retry_s=0.2)
    try:
        assert client.run(client.redis.ping())
        client.failed(ConnectionError("injected"))  # as a failed call reports it
        with pytest.raises(RedisUnavailable):
            client.run(client.redis.ping())
        assert client.breaker.refused == 1 and client.unavailable()
        time.sleep(0.25)
        assert not client.unavailable() and client.run(client.redis.ping())  # the probe answers: closed
        assert client.breaker.state == "closed" and client.healthy
    finally:
        client.close()


def test_a_failed_probe_doubles_the_backoff_up_to_its_cap():
    now = [0.0]
    breaker = CircuitBreaker(1.0, 4.0, clock=lambda: now[0])
    breaker.failed()
    assert not breaker.admit() and breaker.retry_in() == 1.0
    waits = []
    for _ in range(4):
        now[0] += breaker.retry_in()
        assert breaker.admit() and not breaker.admit()  # one probe out, the others refused
        breaker.failed()
        waits.append(breaker.retry_in())
    assert waits == [2.0, 4.0, 4.0, 4.0] and breaker.opened == 1
    now[0] += 4.0
    assert breaker.admit()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.admit()
    breaker.failed()
    assert breaker.retry_in() == 1.0  # a new outage starts from the first backoff


def test_session_bytes_read_while_another_thread_inserts_pages(redis_url):
    ns = f"rkvtest-count-{time.monotonic_ns()}"
    store = RedisPageStore(RedisClient(redis_url), namespace=ns)
    host = HostTier(capacity_bytes=1 << 26, store=store)
    raw = redis.Redis.from_url(redis_url)
    stored = len(pack({k: t[0] for k, t in page(0).items()}))  # what the store counts of one page
    # Another session's many items: a count that walked every item would take a while to read.
    store.put("other", {f"o/{i}": {k: t[0] for k, t in page(i).items()} for i in range(4000)})
    stop, inserted = threading.Event(), []

    def insert() -> None:
        i = 0
        while not stop.is_set() or i < 20:
            pid = f"p/{i}"
            host.put_many("s", [pid], page(i))
            missing = host.unstored("s", [pid])  # a persist: the pages the store lacks, then written
            assert missing is not None and list(missing) == [pid] and store.put("s", missing)
            host.stored("s", list(missing))
            inserted.append(i)
            i += 1

    writer = threading.Thread(target=insert)
    writer.start()
    seen = []
    try:
        for _ in range(10_000):
            seen.append((host.session_bytes("s"), store.session_bytes("s")))
    finally:
        stop.set()
        writer.join()
    try:
        assert len(inserted) >= 20
        for host_bytes, store_bytes in seen:  # whole pages, and the store never ahead of the host's copies
            assert host_bytes % PAGE_BYTES == 0 and store_bytes % stored == 0
            assert store_bytes // stored <= host_bytes // PAGE_BYTES
        assert [h for h, _ in seen] == sorted(h for h, _ in seen) and [r for _, r in seen] == sorted(r for _, r in seen)
        n = len(inserted)
        assert host.session_bytes("s") == n * PAGE_BYTES and store.session_bytes("s") == n * stored
        assert store.stats.bytes == (n + 4000) * stored and store.stats.entries == n + 4000
        store.forget("other")  # a session leaving the process takes its counts along
        assert store.session_bytes("other") == 0 and store.stats.entries == n
        host.drop_session("s")
        assert host.session_bytes("s") == 0 and store.session_bytes("s") == 0 and store.stats.bytes == 0
        assert not raw.exists(kv_key(ns, "s", "p"))  # pending, named by no record: gone with its holder
    finally:
        for key in raw.scan_iter(match=f"{ns}:*"):
            raw.delete(key)
        store.close()
