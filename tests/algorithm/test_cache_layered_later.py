"""A later ``tiered`` turn fed layer by layer (``ComposedCache.begin_layered`` into a cache with history
and cold pages): each layer takes the turn's keys first, its window rows pick the cold pages and Stage
1's choice, then its rows attend in groups. The same outputs, kept tokens, keys and cold pages as the
whole prefill, however the rows are grouped; a layer holds the turn only while it runs; taken back
half way, the cache is released, keeps its history and is marked broken (rebuilt at the next turn)."""
import threading
import time

import pytest
import torch

from cache_drive import SCALING, SPEC, forward, forward_layered, layer_inputs, tier_context
from rocketkv_mt.cache import CacheBroken, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.transfers import Transfers

ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)
FIRST, LATER = 200, 150


def _cache(name: str, reselect: str = "digest", policy: TierPolicy | None = None, transfers=None):
    policy = policy or TierPolicy(page_tokens=8, reselect=reselect)
    return make_cache("tiered", SPEC, ROCKET, tier_context(policy, name, transfers))


@torch.inference_mode()
def _with_history(cache) -> None:
    """A first turn whose tokens past the budget went cold, and two decode steps."""
    gen = torch.Generator().manual_seed(11)
    forward(cache, layer_inputs(gen, FIRST), prefill=True, max_new=2)
    forward(cache, layer_inputs(gen, 1), prefill=False)
    cache.end_turn()
    assert cache.cold_pages() > 0 and cache.layers_later()


@pytest.mark.parametrize("reselect", ["digest", "exhaustive"])
@pytest.mark.parametrize("rows", [7, 64, 150])
@torch.inference_mode()
def test_a_later_turn_fed_layer_by_layer_is_the_whole_prefill(reselect, rows):
    whole, layered = _cache(f"w{rows}{reselect}", reselect), _cache(f"l{rows}{reselect}", reselect)
    for cache in (whole, layered):
        _with_history(cache)
    inputs = layer_inputs(torch.Generator().manual_seed(12), LATER)
    expect = forward(whole, inputs, prefill=True, max_new=3)
    got = forward_layered(layered, inputs, max_new=3, rows=rows)
    for a, b in zip(expect, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    whole.end_turn()  # the whole prefill's re-selection settles; the layered one's did, layer by layer
    layered.end_turn()
    assert layered.history_len == whole.history_len == FIRST + 1 + LATER
    for a, b in zip(whole.layers, layered.layers):
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(b.keys, a.keys, atol=1e-6, rtol=0)
    assert layered.tier_bytes() == whole.tier_bytes() and layered.cold_tokens() == whole.cold_tokens()
    assert layered.readmitted_tokens() == whole.readmitted_tokens()
    # The conversation goes on the same way from either.
    gen = [torch.Generator().manual_seed(13) for _ in range(2)]
    for _ in range(2):
        a, b = (forward(c, layer_inputs(g, 1), prefill=False) for c, g in zip((whole, layered), gen))
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=0)
    for cache in (whole, layered):
        cache.release()


@pytest.mark.parametrize("policy", [TierPolicy(page_tokens=8, reselect="exhaustive"),
                                    TierPolicy(page_tokens=8, sketch_pool=24.0)], ids=["whole-read", "sketch-pool"])
@torch.inference_mode()
def test_each_layer_s_pages_are_read_ahead_while_the_layer_before_runs(policy):
    """With a page reader, a layer's whole read (or its whole pool's sketch decode) starts on it during
    the layer before, as in a whole prefill; the turn is the one fed without a reader."""
    transfers = Transfers(torch.device("cpu"))
    events = []
    start = transfers.start

    def recorded(fn, **kw):
        # Only the read-ahead's own jobs count (a layer's choice may be applied on the reader too).
        if getattr(getattr(fn, "func", None), "__name__", "") in ("_read_whole", "_sketch"):
            events.append("start")
        return start(fn, **kw)

    transfers.start = recorded
    inline, ahead = _cache("inline", policy=policy), _cache("ahead", policy=policy, transfers=transfers)
    for cache in (inline, ahead):
        _with_history(cache)
    window = ahead.layered_window
    ahead.layered_window = lambda layer, q, s: events.append(layer) or window(layer, q, s)
    inputs = layer_inputs(torch.Generator().manual_seed(17), LATER)
    expect = forward_layered(inline, inputs, max_new=3, rows=40)
    events.clear()
    got = forward_layered(ahead, inputs, max_new=3, rows=40)
    for a, b in zip(expect, got):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    for cache in (inline, ahead):  # the last layer may still be applying its choice on the reader
        cache.end_turn()
    for a, b in zip(inline.layers, ahead.layers):
        assert torch.equal(a.positions, b.positions)
    windows = [i for i, e in enumerate(events) if e != "start"]
    assert [events[i] for i in windows] == list(range(SPEC.num_layers))
    for before, at in zip(windows, windows[1:]):  # the next layer's read began before its own window
        assert "start" in events[before + 1 : at], events
    for cache in (inline, ahead):
        cache.release()
    transfers.close()


@torch.inference_mode()
def test_on_a_cpu_a_layer_s_choice_is_applied_on_the_page_reader_and_the_next_layer_waits_for_it():
    """Each layer applies its choice (demoting the turn's tokens) on the page reader; the next layer is
    not ready to take the turn's keys until that is done, and when fed anyway waits for it, as a look at
    the layer's cold pages does; after the last layer, the cache is not ready to decode until it is
    done. Outputs and kept positions are those of a turn applied inline."""
    transfers = Transfers(torch.device("cpu"))
    inline, beside = _cache("inline"), _cache("beside", transfers=transfers)
    for cache in (inline, beside):
        _with_history(cache)
    inputs = layer_inputs(torch.Generator().manual_seed(18), LATER)
    expect = forward_layered(inline, inputs, max_new=3, rows=40)
    apply, threads = beside.prefill.apply, {}
    last = SPEC.num_layers - 1
    gates = {0: threading.Event(), last: threading.Event()}
    entered = {layer: threading.Event() for layer in gates}

    def gated_apply(layer, pending):
        threads[layer] = threading.current_thread().name
        if layer in gates:
            entered[layer].set()
            assert gates[layer].wait(10)
        apply(layer, pending)

    def feed(layer: int) -> torch.Tensor:
        q, k, v = inputs[layer]
        beside.layered_keys(layer, k[0], v[0])
        beside.layered_window(layer, q[0, :, -beside.layered_window_rows():], SCALING)
        return beside.attend(layer, q, k, v, SCALING)

    beside.prefill.apply = gated_apply
    beside.begin_layered(LATER, 3)
    got = [feed(0)]
    assert entered[0].wait(10)  # the reader began it (waited for before that, it would run in the waiter)
    held = beside.layers[0].length
    assert not beside.layered_ready(1) and held > ROCKET.token_budget  # layer 0 still holds the turn
    # A look at the layer's cold pages (the memory map) meanwhile waits for the application too.
    looked = []
    look = threading.Thread(target=lambda: looked.append(beside.prefill.cold_residency(0)))
    look.start()
    look.join(0.3)
    assert look.is_alive() and not looked
    gates[0].set()
    look.join(10)
    assert looked and beside.layers[0].length < held
    got += [feed(layer) for layer in range(1, SPEC.num_layers)]  # layer 1's keys wait for layer 0's application
    beside.end_layered()
    assert entered[last].wait(10)
    for a, b in zip(expect, got):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert inline.decode_ready() and not beside.decode_ready()  # its last layer is still being applied
    gates[last].set()
    deadline = time.monotonic() + 10
    while not beside.decode_ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert beside.decode_ready()
    # The held layers were applied on the reader; any other may have been applied where it was waited for.
    assert threads[0].startswith("rkv-pages") and threads[last].startswith("rkv-pages")
    assert set(threads) == set(range(last + 1))
    for cache in (inline, beside):
        cache.end_turn()
    for a, b in zip(inline.layers, beside.layers):
        assert torch.equal(a.positions, b.positions)
    for cache in (inline, beside):
        cache.release()
    transfers.close()


@torch.inference_mode()
def test_a_layer_holds_the_later_turn_only_while_it_runs():
    cache = _cache("peak")
    _with_history(cache)
    before = [store.length for store in cache.layers]
    seen = []
    forward_layered(cache, layer_inputs(torch.Generator().manual_seed(14), LATER), max_new=3, rows=50,
                    on_group=lambda c: seen.append([store.length for store in c.layers]))
    after = [store.length for store in cache.layers]
    # The running layer holds its selection plus the whole turn; the others their selection only.
    for lengths in seen:
        assert sum(now > max(b, a) for now, b, a in zip(lengths, before, after)) <= 1, lengths
    assert max(max(lengths) for lengths in seen) == max(before) + LATER
    assert max(sum(lengths) for lengths in seen) < sum(before) + LATER + sum(after)  # never in every layer
    cache.release()


@torch.inference_mode()
def test_a_later_turn_taken_back_half_way_leaves_a_broken_cache_with_its_history():
    cache = _cache("undo")
    _with_history(cache)
    host, sid = cache.prefill.tiers.host, cache.prefill.tiers.session_id
    history = cache.history_len
    inputs = layer_inputs(torch.Generator().manual_seed(15), LATER)
    cache.begin_layered(LATER, 3)
    for layer in range(2):  # two layers whole (re-selected), then the keys of a third and half its rows
        q, k, v = inputs[layer]
        cache.layered_keys(layer, k[0], v[0])
        cache.layered_window(layer, q[0, :, -cache.layered_window_rows():], 0.25)
        cache.attend(layer, q, k, v, 0.25)
    q, k, v = inputs[2]
    cache.layered_keys(2, k[0], v[0])
    cache.layered_window(2, q[0, :, -cache.layered_window_rows():], 0.25)
    cache.attend(2, q[:, :, :70], k[:, :, :70], v[:, :, :70], 0.25)
    cache.undo_layered()
    assert cache.broken and cache.history_len == history and cache.step is None
    assert cache.device_bytes() == 0 and not host.session_bytes(sid)
    with pytest.raises(CacheBroken):  # its KV must never reach Redis
        cache.persist()
    cache.release()


@torch.inference_mode()
def test_rows_before_the_whole_turn_s_keys_are_refused():
    cache = _cache("order")
    _with_history(cache)
    q, k, v = layer_inputs(torch.Generator().manual_seed(16), 40)[0]
    cache.begin_layered(40, 2)
    cache.layered_keys(0, k[0, :, :20], v[0, :, :20])
    with pytest.raises(RuntimeError, match="window comes after"):
        cache.layered_window(0, q[0, :, -8:], 0.25)
    with pytest.raises(RuntimeError, match="before the whole turn"):
        cache.attend(0, q[:, :, :20], k[:, :, :20], v[:, :, :20], 0.25)
    cache.undo_layered()
    cache.release()
