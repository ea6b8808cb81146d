"""A tiered re-selection applies whole or leaves the cache as it was. A failure at any step of one (the
host tier full, Redis failing to take a spill, the page reader's choice failing, a step of the
application itself) leaves every layer and KV head holding each position of the history exactly once,
on the device or cold, and the next turn runs; a failure that cannot be undone marks the cache
broken, and a broken cache refuses to go on."""
import secrets
import threading

import pytest
import redis
import torch

import rocketkv_mt.cache.prefill.tiered.choice as choice
from cache_drive import SPEC, forward, layer_inputs
from rocketkv_mt.cache import CacheBroken, TierContext, TierPolicy, make_cache
from rocketkv_mt.cache.decode.hsa import HSADecode
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import RocketKVConfig
from tiers.cold.layer import ColdLayer
from tiers.host.tier import HostFull, HostTier
from tiers.store.redis.client import RedisClient
from tiers.store.redis.pages import RedisPageStore
from tiers.transfers import Transfers

ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)
# Never read whole: every layer's choice is made in its prefill and applied at its turn's end.
DEFERRED = TierPolicy(page_tokens=8, read_whole=0)
# Always read whole: a layer's choice is applied at once, on the page reader where there is one.
AT_ONCE = TierPolicy(page_tokens=8, read_whole=1000)
PAGE_BYTES = 2 * 8 * SPEC.head_dim * 4  # keys and values of one page of one KV head, float32


def tiered(host: HostTier, policy: TierPolicy = DEFERRED, reader: Transfers | None = None, name: str = "atomic"):
    return make_cache("tiered", SPEC, ROCKET, tiers=TierContext(host, name, policy, transfers=reader))


def positions_held(cache, layer: int, head: int) -> torch.Tensor:
    held = torch.cat([cache.layers[layer].positions[head].cpu(), cache.prefill.cold[layer].held_positions(head)])
    return held.sort().values


def assert_held_once(cache, layers=None, length: int | None = None) -> None:
    """Each of the ``length`` (default: the history's) positions is held exactly once per layer and KV
    head: kept on the device or alive in a cold page."""
    length = cache.history_len if length is None else length
    for layer in range(SPEC.num_layers) if layers is None else layers:
        for head in range(SPEC.num_kv_heads):
            assert torch.equal(positions_held(cache, layer, head), torch.arange(length)), (layer, head)


@torch.inference_mode()  # as the model runner steps
def prefill(cache, gen: torch.Generator, n: int, max_new: int = 2) -> None:
    forward(cache, layer_inputs(gen, n), prefill=True, max_new=max_new)


@torch.inference_mode()
def turn(cache, gen: torch.Generator, n: int, max_new: int = 2) -> None:
    prefill(cache, gen, n, max_new)
    for _ in range(max_new):
        forward(cache, layer_inputs(gen, 1), prefill=False)
    cache.end_turn()


def two_turns_then_a_prefill(cache, gen: torch.Generator) -> None:
    """A long first turn, a short one that promotes and demotes, then a third turn's prefill, left
    before its first decode step: every layer's re-selection is pending."""
    turn(cache, gen, 200)
    turn(cache, gen, 12)
    assert cache.readmitted > 0  # the second turn brought cold tokens back
    prefill(cache, gen, 9)
    assert all(p is not None for p in cache.prefill._pending)


def fail_host_store(monkeypatch, fail_at: int, error: Exception) -> None:
    """The ``fail_at``-th store of pages into the host tier from now on raises ``error``, storing
    nothing; the others store."""
    calls = []
    put_many = HostTier.put_many

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise error
        return put_many(self, *args, **kwargs)

    monkeypatch.setattr(HostTier, "put_many", failing)


@pytest.mark.parametrize("fail_at", [1, SPEC.num_layers], ids=["first-layer", "last-layer"])
def test_a_full_host_tier_at_the_demotion_leaves_each_position_held_once(monkeypatch, fail_at):
    host = HostTier(64 << 20, None, pin=False)
    cache = tiered(host)
    gen = torch.Generator().manual_seed(11)
    two_turns_then_a_prefill(cache, gen)
    host_bytes = host.session_bytes("atomic")
    fail_host_store(monkeypatch, fail_at, HostFull("injected: no slot and nothing can spill"))
    with pytest.raises(HostFull, match="injected"):
        cache.end_turn()
    assert_held_once(cache)
    assert not cache.broken
    # The layers before the failing one were applied; the failing one kept its turn's tokens, unselected.
    budget = cache.split.prompt_budget
    assert [store.length for store in cache.layers[:fail_at]] == [budget] * (fail_at - 1) + [
        cache.layers[fail_at - 1].length] and cache.layers[fail_at - 1].length > budget
    assert host.session_bytes("atomic") >= host_bytes
    cache.end_turn()  # what is left pending settles now
    assert_held_once(cache)
    turn(cache, gen, 7)  # and the next turn selects over what the failed layer kept
    assert_held_once(cache)
    assert [store.length for store in cache.layers] == [cache.split.prompt_budget + 2] * SPEC.num_layers


def test_redis_failing_to_take_a_spill_leaves_each_position_held_once(redis_url):
    # A host tier of 48 pages, far fewer than the history's: every turn spills to Redis.
    store = RedisPageStore(RedisClient(redis_url), namespace=f"rkvtest-{secrets.token_hex(4)}")
    host = HostTier(48 * PAGE_BYTES, store, pin=False, page_bytes=PAGE_BYTES)
    try:
        cache = tiered(host)
        gen = torch.Generator().manual_seed(12)
        two_turns_then_a_prefill(cache, gen)
        assert host.stats.spills > 0
        put = store.put
        store.put = lambda *args, **kwargs: False  # as a write that fails (timeout, connection lost)
        with pytest.raises(HostFull, match="spilling failed"):
            cache.end_turn()
        assert_held_once(cache)
        assert not cache.broken
        store.put = put  # Redis is back
        turn(cache, gen, 7)
        assert_held_once(cache)
    finally:
        raw = redis.Redis.from_url(redis_url)
        for key in raw.scan_iter(match=f"{store.ns}:*"):
            raw.delete(key)
        store.close()


def test_a_choice_that_fails_on_the_page_reader_leaves_the_cache_as_it_was(monkeypatch):
    transfers = Transfers(torch.device("cpu"))
    calls = []
    choose = choice.choose_over_parts

    def failing_last_layer(*args, **kwargs):
        # The first turn selects with nothing cold, by no choice over parts; the second and third
        # make one per layer. The third turn's choice of its last layer, made on the reader, fails.
        calls.append(threading.current_thread().name)
        if len(calls) == 2 * SPEC.num_layers:
            assert calls[-1].startswith("rkv-pages")
            raise RuntimeError("injected: the page reader's choice failed")
        return choose(*args, **kwargs)

    monkeypatch.setattr(choice, "choose_over_parts", failing_last_layer)
    try:
        cache = tiered(HostTier(64 << 20, None, pin=False), reader=transfers)
        gen = torch.Generator().manual_seed(13)
        two_turns_then_a_prefill(cache, gen)
        with pytest.raises(RuntimeError, match="injected"):
            cache.end_turn()
        assert_held_once(cache)
        assert all(p is None for p in cache.prefill._pending)
        turn(cache, gen, 7)  # a failed choice is not tried again: the next turn runs
        assert_held_once(cache)
        assert not cache.broken
    finally:
        transfers.close()


def test_a_layer_applied_on_the_page_reader_applies_whole_or_not_at_all(monkeypatch):
    transfers = Transfers(torch.device("cpu"))
    try:
        cache = tiered(HostTier(64 << 20, None, pin=False), AT_ONCE, reader=transfers)
        gen = torch.Generator().manual_seed(14)
        turn(cache, gen, 200)
        turn(cache, gen, 12)
        # The next turn's first layer is applied on the reader (beside the second layer), where its
        # demotion finds the host tier full: the second layer, which waits for it, fails.
        fail_host_store(monkeypatch, 1, HostFull("injected: no slot and nothing can spill"))
        n = 9
        inputs = layer_inputs(gen, n)
        with torch.inference_mode():
            cache.begin_forward(n, prefill=True, max_new=2)
            cache.attend(0, *inputs[0], SPEC.head_dim ** -0.5)
            with pytest.raises(HostFull, match="injected"):
                cache.attend(1, *inputs[1], SPEC.head_dim ** -0.5)
        # The forward failed part-way (the engine drops such a cache), but the first layer is as its
        # attention left it: the turn's tokens on the device beside the old primary set, none lost.
        assert_held_once(cache, layers=[0], length=cache.history_len + n)
        cache.release()
    finally:
        transfers.close()


@pytest.mark.parametrize("step", ["promote", "store", "decode set"])
def test_a_step_of_the_application_that_fails_marks_the_cache_broken(monkeypatch, step):
    host = HostTier(64 << 20, None, pin=False)
    cache = tiered(host)
    gen = torch.Generator().manual_seed(15)
    two_turns_then_a_prefill(cache, gen)
    owner, name = {"promote": (ColdLayer, "promote"), "store": (LayerKV, "replace"),
                   "decode set": (HSADecode, "prepare")}[step]

    def failing(*args, **kwargs):
        raise RuntimeError(f"injected: {step} failed")

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(RuntimeError, match="injected"):
        cache.end_turn()
    assert cache.broken  # half-updated: it must never be used again
    monkeypatch.undo()
    with pytest.raises(CacheBroken):
        cache.end_turn()
    with pytest.raises(CacheBroken):
        cache.persist()
    with pytest.raises(CacheBroken):
        prefill(cache, gen, 5)
    cache.release()  # its pages, the failed layer's new ones included, are freed
    assert host.session_bytes("atomic") == 0 and host.stats.entries == 0


@torch.inference_mode()
def test_a_deferred_selection_that_fails_is_tried_again(monkeypatch):
    # A first prompt fed in chunks selects after its last chunk, layer by layer, later: a selection
    # whose demotion fails leaves its layer unselected and whole, and the next try selects it.
    host = HostTier(64 << 20, None, pin=False)
    cache = tiered(host)
    gen = torch.Generator().manual_seed(16)
    forward(cache, layer_inputs(gen, 120), prefill=True, max_new=2, rest=80)
    forward(cache, layer_inputs(gen, 80), prefill=True, max_new=2)
    assert cache.unselected_layers() == SPEC.num_layers
    fail_host_store(monkeypatch, 2, HostFull("injected: no slot and nothing can spill"))
    with pytest.raises(HostFull, match="injected"):
        cache.select_pending()
    assert cache.unselected_layers() == SPEC.num_layers - 1
    assert_held_once(cache)
    for _ in range(2):
        forward(cache, layer_inputs(gen, 1), prefill=False)  # each layer selects before its step
    cache.end_turn()
    assert cache.unselected_layers() == 0
    assert_held_once(cache)
    assert [store.length for store in cache.layers] == [cache.split.prompt_budget + 2] * SPEC.num_layers
