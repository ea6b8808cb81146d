"""A first prompt fed layer by layer (``ComposedCache.begin_layered``): in every mode the same outputs,
kept tokens and keys as a whole prefill, however the rows are grouped; each layer holds the whole
prompt only while it is the one running; taken back half way, the cache is empty and serves a new
first turn as a fresh one does, with nothing left in the host tier."""
import threading

import pytest
import torch

from cache_drive import SCALING, SPEC, forward, forward_layered, layer_inputs, tier_context
from rocketkv_mt.cache import CACHE_MODES, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.transfers import Transfers

MODES = sorted(CACHE_MODES)
ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)


def _pair(mode: str, name: str):
    return [make_cache(mode, SPEC, ROCKET, tier_context(session_id=f"{name}-{mode}-{i}")) for i in range(2)]


@torch.inference_mode()
def _rest_of_conversation(cache, gen: torch.Generator) -> list[torch.Tensor]:
    """Two decode steps and a short second turn with one decode step: every layer's outputs."""
    outs = []
    for _ in range(2):
        outs += forward(cache, layer_inputs(gen, 1), prefill=False)
    cache.end_turn()
    outs += forward(cache, layer_inputs(gen, 12), prefill=True, max_new=2)
    outs += forward(cache, layer_inputs(gen, 1), prefill=False)
    cache.end_turn()
    return outs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [7, 64, 200])
@torch.inference_mode()
def test_a_prompt_fed_layer_by_layer_is_the_whole_prefill(mode, rows):
    whole, by_layer = _pair(mode, f"same{rows}")
    inputs = layer_inputs(torch.Generator().manual_seed(3), 150)
    expect = forward(whole, inputs, prefill=True, max_new=4)
    got = forward_layered(by_layer, inputs, max_new=4, rows=rows)
    for a, b in zip(expect, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert by_layer.history_len == whole.history_len == 150
    for a, b in zip(whole.layers, by_layer.layers):
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(b.keys, a.keys, atol=1e-6, rtol=0)
    assert by_layer.tier_bytes() == whole.tier_bytes()
    if mode not in ("full", "rocketkv-mt"):
        assert whole.kept_tokens() < 150  # Stage 1 did compress
    # The conversation goes on the same way from either.
    later = [_rest_of_conversation(c, torch.Generator().manual_seed(4)) for c in (whole, by_layer)]
    for a, b in zip(*later):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    for cache in (whole, by_layer):
        cache.release()


@pytest.mark.parametrize("mode", ["snapkv", "tiered"])
@torch.inference_mode()
def test_a_layer_holds_its_whole_prompt_only_while_it_runs(mode):
    cache, _ = _pair(mode, "peak")
    n, rows = 150, 50
    seen = []

    def on_group(c):
        seen.append([store.length for store in c.layers])

    forward_layered(cache, layer_inputs(torch.Generator().manual_seed(5), n), max_new=4, rows=rows, on_group=on_group)
    kept = cache.kept_tokens()
    assert kept < n
    # Layer 0 grows to the whole prompt and selects with its last group; then layer 1 grows, and so on:
    # the layers before the running one hold their selections, the layers after it nothing yet.
    assert seen[:4] == [[50, 0, 0], [100, 0, 0], [kept, 0, 0], [kept, 50, 0]]
    for lengths in seen:
        assert sum(length > kept for length in lengths) <= 1, lengths
    assert max(sum(lengths) for lengths in seen) == 2 * kept + 100  # never the prompt in every layer
    cache.release()


@torch.inference_mode()
def test_on_a_cpu_a_tiered_layer_selects_on_the_page_reader_and_the_next_layer_waits_for_it():
    """A first prompt: each layer's Stage 1 and demotion run on the page reader; the next layer is not
    ready to start until they are done, and started anyway waits for them, so one layer at a time
    holds the prompt; after the last, the cache is not ready to decode until it is done. Outputs, kept
    positions and cold pages are those of the prompt selected inline."""
    transfers = Transfers(torch.device("cpu"))
    policy = TierPolicy(page_tokens=8)
    inline = make_cache("tiered", SPEC, ROCKET, tier_context(policy, "select-inline"))
    beside = make_cache("tiered", SPEC, ROCKET, tier_context(policy, "select-beside", transfers))
    inputs = layer_inputs(torch.Generator().manual_seed(6), 150)
    expect = forward_layered(inline, inputs, max_new=4, rows=50)
    select, threads = beside.prefill.select, {}
    last = SPEC.num_layers - 1
    gates = {1: threading.Event(), last: threading.Event()}
    entered = {layer: threading.Event() for layer in gates}

    def gated_select(layer, q_win, scaling):
        threads[layer] = threading.current_thread().name
        if layer in gates:
            entered[layer].set()
            assert gates[layer].wait(10)
        select(layer, q_win, scaling)

    def feed(layer: int, a: int) -> torch.Tensor:
        q, k, v = (x[:, :, a : a + 50] for x in inputs[layer])
        return beside.attend(layer, q, k, v, SCALING)

    beside.prefill.select = gated_select
    beside.begin_layered(150, 4)
    got = [[feed(layer, a) for a in range(0, 150, 50)] for layer in range(2)]
    assert entered[1].wait(10)  # the reader began it (waited for before that, it would run in the waiter)
    assert not beside.layered_ready(2) and beside.layers[1].length == 150 > inline.kept_tokens()  # still held
    # Started anyway, layer 2 waits for layer 1's selection before it takes its first group.
    first = []

    @torch.inference_mode()  # per thread, as the model thread runs it
    def feed_first_group():
        first.append(feed(2, 0))

    started = threading.Thread(target=feed_first_group)
    started.start()
    started.join(0.3)
    assert started.is_alive() and beside.layers[2].length == 0 and beside.layers[1].length == 150
    gates[1].set()
    started.join(10)
    assert first and beside.layers[1].length == inline.kept_tokens()
    got.append([first[0], *(feed(2, a) for a in range(50, 150, 50))])
    for layer in range(3, SPEC.num_layers):
        got.append([])
        for a in range(0, 150, 50):
            got[layer].append(feed(layer, a))
            assert sum(store.length > inline.kept_tokens() for store in beside.layers) <= 1
    beside.end_layered()
    assert entered[last].wait(10)
    assert inline.decode_ready() and not beside.decode_ready()
    gates[last].set()
    beside.end_turn()  # settles: waits for the last layer
    # The held layers ran on the page reader; any other may have run here, where it was waited for
    # before the reader began it (``Transfers.wait``).
    assert beside.decode_ready() and threads[1].startswith("rkv-pages") and threads[last].startswith("rkv-pages")
    assert set(threads) == set(range(last + 1))
    for a, b in zip(expect, got):
        torch.testing.assert_close(torch.cat(b, dim=1), a, atol=1e-6, rtol=0)
    inline.end_turn()
    for a, b in zip(inline.layers, beside.layers):
        assert torch.equal(a.positions, b.positions)
    assert beside.tier_bytes() == inline.tier_bytes() and beside.cold_tokens() == inline.cold_tokens()
    for cache in (inline, beside):
        cache.release()
    transfers.close()


@pytest.mark.parametrize("mode", MODES)
@torch.inference_mode()
def test_taken_back_half_way_the_cache_is_as_new(mode):
    stopped, fresh = _pair(mode, "undo")
    host = stopped.prefill.tiers.host if mode == "tiered" else None
    gen = torch.Generator().manual_seed(6)
    inputs = layer_inputs(gen, 150)
    stopped.begin_layered(150, 4)
    for layer, (q, k, v) in enumerate(inputs[:2]):  # two layers whole (selected: tiered demoted), then half of one
        stopped.attend(layer, q, k, v, 0.25)
    q, k, v = inputs[2]
    stopped.attend(2, q[:, :, :70], k[:, :, :70], v[:, :, :70], 0.25)
    if mode == "tiered":
        assert stopped.tier_bytes()["host"] > 0
    stopped.undo_layered()
    assert stopped.history_len == 0 and stopped.device_bytes() == 0 and stopped.step is None
    assert stopped.tier_bytes() == {"device": 0, "host": 0, "redis": 0}
    if host is not None:
        assert not host.session_bytes(stopped.prefill.tiers.session_id)
    # A first turn now goes as in a cache that never saw the stopped one.
    again = layer_inputs(torch.Generator().manual_seed(7), 90)
    a = forward_layered(stopped, again, max_new=3, rows=40)
    b = forward_layered(fresh, again, max_new=3, rows=40)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    for x, y in zip(stopped.layers, fresh.layers):
        assert torch.equal(x.positions, y.positions) and torch.equal(x.keys, y.keys)
    for cache in (stopped, fresh):
        cache.release()


def test_a_cache_with_history_is_fed_layer_by_layer_only_where_its_policy_says_so():
    cache, _ = _pair("rocketkv", "refuse")
    forward(cache, layer_inputs(torch.Generator().manual_seed(8), 20), prefill=True, max_new=2)
    assert not cache.layers_later()  # its later turns are fed in chunks
    with pytest.raises(RuntimeError, match="cannot be fed layer by layer"):
        cache.begin_layered(100, 2)
    cache.release()


@torch.inference_mode()
def test_nothing_is_persisted_between_two_groups():
    cache, _ = _pair("tiered", "persist")
    inputs = layer_inputs(torch.Generator().manual_seed(9), 120)
    cache.begin_layered(120, 2)
    q, k, v = inputs[0]
    cache.attend(0, q, k, v, 0.25)
    with pytest.raises(RuntimeError, match="prefill is under way"):
        cache.persist()
    cache.undo_layered()
    cache.release()
