"""A store into a full host tier while another thread's spill holds every page in flight waits for that
store to land and spills its pages, instead of failing as if Redis were gone. Real Redis.

The page reader promotes pages read back from Redis (spilling the least recently used ones) while the
model thread demotes: with a tight host tier the promotion's spill can hold every slot at the moment the
demotion looks for one.
"""
import secrets
import threading

import pytest
import torch

from tiers.host import HostTier
from tiers.redis_client import RedisClient
from tiers.redis_tier import RedisTier

P, D = 16, 8
PAGE_BYTES = 2 * P * D * 4


def pages(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(n, P, D, generator=g), "values": torch.randn(n, P, D, generator=g)}


@pytest.fixture
def host(redis_url):
    tier = RedisTier(RedisClient(redis_url, timeout_s=5.0), namespace=f"rkvtest-{secrets.token_hex(3)}")
    host = HostTier(capacity_bytes=2 * PAGE_BYTES, redis=tier)
    yield host
    for sid in ("s", "t"):
        host.forget_session(sid)
        tier.delete_session(sid)
    tier.close()


def hold_next_spill(host: HostTier) -> tuple[threading.Event, threading.Event]:
    """(entered, go): the next write of pages to Redis sets ``entered`` and waits for ``go``."""
    entered, go = threading.Event(), threading.Event()
    put = host.redis.put_pages

    def held(session_id, batch):
        host.redis.put_pages = put
        entered.set()
        assert go.wait(30)
        return put(session_id, batch)

    host.redis.put_pages = held
    return entered, go


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(_outcome(fn)))
    thread.start()
    return thread, out


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what the thread met
        return exc


@pytest.mark.parametrize("spiller", ["demotion", "promotion"])
def test_a_store_waits_for_the_spill_in_flight_and_spills_what_it_landed(host, spiller):
    a, b, c = pages(1, 2), pages(2, 2), pages(3, 1)
    host.put_many("s", ["a0", "a1"], a)
    if spiller == "promotion":
        host.put_many("s", ["b0", "b1"], b)  # a0 and a1 spill to Redis
        entered, go = hold_next_spill(host)
        first, result = in_thread(lambda: host.read_many("s", ["a0", "a1"]))  # read back, promoted: b0, b1 spill
    else:
        entered, go = hold_next_spill(host)
        first, result = in_thread(lambda: host.put_many("s", ["b0", "b1"], b))  # a0 and a1 spill
    assert entered.wait(30)
    assert host.stats.entries == 2 and host.free_bytes() == 0  # every slot's page is being spilled

    second, stored = in_thread(lambda: host.put_many("t", ["c0"], c))
    second.join(0.3)
    assert second.is_alive()  # it waits for the first to land instead of failing
    go.set()
    first.join(30)
    second.join(30)

    assert stored == [PAGE_BYTES] and not isinstance(result[0], Exception), (stored, result)
    assert host.stats.bytes <= 2 * PAGE_BYTES and host.where("t", "c0") == "host" and host.exhausted == 0
    # Nothing was lost on the way: every page reads back as written, from whichever tier holds it.
    got, _ = host.read_many("s", ["a0", "a1", "b0", "b1"])
    assert torch.equal(got["keys"], torch.cat([a["keys"], b["keys"]]))
    assert torch.equal(got["values"], torch.cat([a["values"], b["values"]]))
    assert torch.equal(host.read_many("t", ["c0"])[0]["values"], c["values"])
