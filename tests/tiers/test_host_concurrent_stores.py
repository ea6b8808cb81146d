"""Stores into a full host tier while another thread's spill holds every page in flight. Real Redis.

The page reader promotes pages read back from Redis (spilling the least recently used ones) while the
model thread demotes: with a tight host tier the first one's spill can hold every slot at the moment
the other looks for one. A demotion then waits for that store to land and spills its pages, instead of
failing as if Redis were gone; a promotion (best effort, on a reader's path) does not wait; a spill
whose write raises leaves its pages resident, not spilling for good.
"""
import random
import secrets
import threading
import time

import pytest
import redis
import torch

from tiers.host.tier import HostFull, HostTier
from tiers.store.redis.client import RedisClient
from tiers.store.redis.pages import RedisPageStore

P, D = 16, 8
PAGE_BYTES = 2 * P * D * 4


def pages(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(n, P, D, generator=g), "values": torch.randn(n, P, D, generator=g)}


@pytest.fixture
def host(redis_url):
    ns = f"rkvtest-{secrets.token_hex(3)}"
    store = RedisPageStore(RedisClient(redis_url, timeout_s=5.0), namespace=ns)
    host = HostTier(capacity_bytes=2 * PAGE_BYTES, store=store)
    yield host
    for sid in ("s", "t", "u", "warm", "w0", "w1", "w2"):
        host.drop_session(sid)
    raw = redis.Redis.from_url(redis_url)
    for key in raw.scan_iter(match=f"{ns}:*"):
        raw.delete(key)
    store.close()


def where(host: HostTier, sid: str, pid: str) -> str:
    return host.where_many(sid, [pid])[0]


def hold_next_spill(host: HostTier) -> tuple[threading.Event, threading.Event]:
    """(entered, go): the next write of pages to Redis sets ``entered`` and waits for ``go``."""
    entered, go = threading.Event(), threading.Event()
    put = host.store.put

    def held(session_id, items):
        host.store.put = put
        entered.set()
        assert go.wait(30)
        return put(session_id, items)

    host.store.put = held
    return entered, go


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - the test looks at what the thread met
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def every_page_reads_back(host: HostTier, written: dict[str, dict[str, dict[str, torch.Tensor]]]) -> None:
    for sid, by_page in written.items():
        got, _ = host.read_many(sid, list(by_page))
        for i, page in enumerate(by_page.values()):
            assert torch.equal(got["keys"][i], page["keys"][0]) and torch.equal(got["values"][i], page["values"][0])


def one(batch: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {k: t[i : i + 1] for k, t in batch.items()}


@pytest.mark.parametrize("spiller", ["demotion", "promotion"])
def test_stores_wait_for_the_spill_in_flight_and_spill_what_it_landed(host, spiller):
    a, b, c, e = pages(1, 2), pages(2, 2), pages(3, 1), pages(4, 1)
    host.put_many("s", ["a/0", "a/1"], a)
    if spiller == "promotion":
        host.put_many("s", ["b/0", "b/1"], b)  # a0 and a1 spill to Redis
        entered, go = hold_next_spill(host)
        first, result = in_thread(lambda: host.read_many("s", ["a/0", "a/1"]))  # read back, promoted: b0, b1 spill
    else:
        entered, go = hold_next_spill(host)
        first, result = in_thread(lambda: host.put_many("s", ["b/0", "b/1"], b))  # a0 and a1 spill
    assert entered.wait(30)
    assert host.stats.entries == 2 and host.free_bytes() == 0  # every slot's page is being spilled

    # Two demotions arrive meanwhile: both wait for the first store to land instead of failing.
    second, stored = in_thread(lambda: host.put_many("t", ["c/0"], c))
    third, stored_too = in_thread(lambda: host.put_many("u", ["e/0"], e))
    until(lambda: host.waits >= 2)
    assert second.is_alive() and third.is_alive()
    go.set()
    for thread in (first, second, third):
        thread.join(30)

    assert stored == [PAGE_BYTES] and stored_too == [PAGE_BYTES] and not isinstance(result[0], Exception), result
    assert host.stats.bytes <= 2 * PAGE_BYTES and host.exhausted == 0
    assert where(host, "t", "c/0") == where(host, "u", "e/0") == "host"
    # Nothing was lost on the way: every page reads back as written, from whichever tier holds it.
    every_page_reads_back(host, {"s": {"a/0": one(a, 0), "a/1": one(a, 1), "b/0": one(b, 0), "b/1": one(b, 1)},
                                 "t": {"c/0": c}, "u": {"e/0": e}})


def test_a_promotion_does_not_wait_for_a_spill_in_flight(host):
    a, b, c = pages(1, 2), pages(2, 2), pages(3, 1)
    host.put_many("s", ["a/0", "a/1"], a)
    host.put_many("s", ["b/0", "b/1"], b)  # a0 and a1 spill to Redis
    entered, go = hold_next_spill(host)
    first, stored = in_thread(lambda: host.put_many("t", ["c/0", "c/1"], pages(3, 2)))  # b0 and b1 spill
    try:
        assert entered.wait(30)
        start = time.monotonic()
        got, from_redis = host.read_many("s", ["a/0"])  # its promotion finds no page to spill: not kept
        assert time.monotonic() - start < 2.0 and host.waits == 0
        assert from_redis == PAGE_BYTES and torch.equal(got["keys"], one(a, 0)["keys"])
        assert where(host, "s", "a/0") == "redis"
    finally:
        go.set()
        first.join(30)
    assert stored == [2 * PAGE_BYTES]
    assert torch.equal(host.read_many("t", ["c/0"])[0]["keys"], one(c, 0)["keys"])


def test_a_spill_whose_write_raises_leaves_its_pages_resident_and_no_slot_taken(host):
    a, b = pages(1, 2), pages(2, 2)
    host.put_many("s", ["a/0", "a/1"], a)
    put = host.store.put

    def broken(session_id, items):
        host.store.put = put
        raise RuntimeError("injected: the write raised")

    host.store.put = broken
    with pytest.raises(RuntimeError, match="injected"):
        host.put_many("t", ["b/0", "b/1"], b)
    assert [where(host, "s", p) for p in ("a/0", "a/1")] == ["host", "host"] and where(host, "t", "b/0") == "none"
    assert host.stats.bytes == 2 * PAGE_BYTES and host.free_bytes() == 0  # no slot lost, none taken
    host.put_many("t", ["b/0", "b/1"], b)  # the next store spills both pages: neither is stuck spilling
    assert host.stats.spills == 2 and where(host, "t", "b/0") == where(host, "t", "b/1") == "host"
    every_page_reads_back(host, {"s": {"a/0": one(a, 0), "a/1": one(a, 1)}, "t": {"b/0": one(b, 0), "b/1": one(b, 1)}})


def test_stores_that_nothing_in_flight_can_make_room_for_fail_at_once(host, monkeypatch):
    host.put_many("warm", ["x/0"], pages(0, 1))  # the pool takes its page shape from a first page
    host.free_many("warm", ["x/0"])
    with monkeypatch.context() as m:  # a turn held a slot while Redis was down: one of two is free
        m.setattr(host.store, "unavailable", lambda *a: True)
        assert host.reserve("c", 1) and host.reserved_bytes() == PAGE_BYTES
    start = time.monotonic()
    threads = [in_thread(lambda i=i: host.put_many(f"w{i}", ["p/0", "p/1"], pages(i, 2))) for i in range(3)]
    for thread, _ in threads:
        thread.join(30)
    # Each needs two slots, one is free and no page could spill: each is refused, none waits for another.
    assert all(isinstance(out[0], HostFull) and "held for other turns" in str(out[0]) for _, out in threads)
    assert time.monotonic() - start < 5 and host.exhausted == 3
    host.release("c")
    assert host.free_bytes() == 2 * PAGE_BYTES and host.stats.bytes == 0


def test_readers_and_writers_at_once_keep_every_page_and_every_slot(host):
    """Three writers (store, read back, free) and two readers of one shared session on a two-slot tier
    for two seconds: every read gives the bytes written, no store is refused while Redis is healthy,
    and at the end every slot is free or holds a resident page."""
    stop, problems = threading.Event(), []
    shared = {f"sh/{i}": 10_000 + i for i in range(3)}
    host.put_many("s", list(shared), _stack(shared))

    def check(sid, seeds):
        got, _ = host.read_many(sid, list(seeds))
        want = _stack(seeds)
        if not all(torch.equal(got[k], want[k]) for k in want):
            problems.append(f"wrong bytes read back for {sid}")

    def writer(i):
        rnd, live, n = random.Random(i), {}, 0
        while not stop.is_set():
            r = rnd.random()
            if r < 0.35 or not live:
                new = {f"{i}/{n + j}": i * 1_000_000 + n + j for j in range(rnd.randint(1, 2))}
                n += len(new)
                host.put_many(f"w{i}", list(new), _stack(new))
                live.update(new)
            elif r < 0.75:
                check(f"w{i}", {p: live[p] for p in rnd.sample(sorted(live), min(len(live), rnd.randint(1, 3)))})
            else:
                gone = rnd.sample(sorted(live), 1)
                host.free_many(f"w{i}", gone)
                del live[gone[0]]
        host.free_many(f"w{i}", list(live))

    def reader(i):
        rnd = random.Random(100 + i)
        while not stop.is_set():
            check("s", {p: shared[p] for p in rnd.sample(sorted(shared), rnd.randint(1, len(shared)))})

    threads = [in_thread(lambda i=i: writer(i)) for i in range(3)] + [in_thread(lambda i=i: reader(i)) for i in range(2)]
    time.sleep(2)
    stop.set()
    for thread, _ in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread, _ in threads)
    assert [out for _, out in threads] == [[None]] * 5 and problems == []  # nothing raised, HostFull included
    assert host.exhausted == 0 and host.stats.bytes <= host.capacity_bytes
    host.free_many("s", list(shared))
    assert host.stats.bytes == 0 and host.free_bytes() == host.capacity_bytes  # no slot lost


def _stack(seeds: dict[str, int]) -> dict[str, torch.Tensor]:
    ps = [pages(seed, 1) for seed in seeds.values()]
    return {k: torch.cat([p[k] for p in ps]) for k in ps[0]}


def test_a_page_freed_while_a_reader_reads_it_back_does_not_come_back(host):
    a, b = pages(1, 2), pages(2, 2)
    host.put_many("s", ["a/0", "a/1"], a)
    host.put_many("t", ["b/0", "b/1"], b)  # a0 and a1 spill to Redis
    entered, go = threading.Event(), threading.Event()
    get = host.store.get

    def held(session_id, names):  # read, and not yet promoted, when the free comes
        fetched = get(session_id, names)
        entered.set()
        assert go.wait(30)
        return fetched

    host.store.get = held
    reader, got = in_thread(lambda: host.read_many("s", ["a/0"]))
    assert entered.wait(30)
    host.free_many("s", ["a/0"])  # the session let go of the page meanwhile
    go.set()
    reader.join(30)
    assert torch.equal(got[0][0]["keys"], one(a, 0)["keys"])  # the read itself is answered
    assert where(host, "s", "a/0") == "none" and host.stats.bytes == 2 * PAGE_BYTES  # its promotion is not kept
    assert host.store.has("s", ["a/0", "a/1"]) == [False, True]  # nor its copy: no record names it
    assert [where(host, "t", p) for p in ("b/0", "b/1")] == ["host", "host"]  # nor made room for
