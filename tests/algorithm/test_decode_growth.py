"""A decode step appends to every layer of every decoding session at once, so stores (and KT bounds)
that outgrow their buffers in the same step make that step pay for all of them: the pause every
stream sees. Layers are given different leads, so each grows on a step of its own."""
import pytest
import torch

from rocketkv_mt.cache import CacheSpec, make_cache
from rocketkv_mt.cache.decode.hsa import HSADecode
from rocketkv_mt.cache.batch import BatchCache
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit, RocketKVConfig
from rocketkv_mt.kt_cache import KT_SPARE_PAGES, KTCache
from rocketkv_mt.native import hsa as native_hsa

HKV, G, D, LAYERS = 2, 2, 8, 8


def test_reserve_with_a_lead_grows_and_zeroes_that_many_tokens_early():
    store = LayerKV(HKV, D, torch.float32, torch.device("cpu"), chunk=64)
    k = torch.randn(HKV, 20, D)
    store.append(k, k + 1, torch.arange(20))
    cap = store.buffers[0].shape[1]
    lead = cap - 20 - store.SLACK  # the next token alone would fit; with the lead it does not
    store.reserve(21)
    assert store.buffers[0].shape[1] == cap
    store.reserve(21, lead)
    keys, values = store.buffers
    assert keys.shape[1] >= 21 + lead + store.SLACK > cap
    torch.testing.assert_close(store.keys, k, atol=0, rtol=0)
    torch.testing.assert_close(store.values, k + 1, atol=0, rtol=0)
    assert torch.equal(store.positions[0], torch.arange(20))
    # The slots a kernel may read whole (the partial last page, the slack) hold zeros, not garbage.
    assert not keys[:, 20 : 21 + store.SLACK + lead].any() and not values[:, 20 : 21 + store.SLACK + lead].any()


def test_kt_next_slot_with_a_lead_grows_that_many_pages_early():
    keys = torch.randn(HKV, 32, D)
    kt = KTCache(keys, page_size=4, spare_pages=4, backend="torch")
    capacity = kt.buffer.shape[2]
    assert (kt.pages, capacity) == (8, 12)
    before = kt.bounds.clone()
    assert kt.next_slot(3) == (8, True) and kt.buffer.shape[2] == capacity  # 8 + 3 pages fit in 12
    assert kt.next_slot(4) == (8, True) and kt.buffer.shape[2] > capacity
    torch.testing.assert_close(kt.bounds, before, atol=0, rtol=0)
    assert not kt.buffer[:, :, kt.pages :].any()


@pytest.mark.skipif(not native_hsa.supports(torch.zeros(1)), reason="no C compiler")
@pytest.mark.parametrize("mode", ["full", "rocketkv", "rocketkv-mt"])
def test_the_layers_of_decoding_sessions_grow_on_different_steps(mode):
    spec = CacheSpec(LAYERS, HKV, D, torch.float32, torch.device("cpu"), kernels="native")
    rocket = RocketKVConfig(token_budget=16, window_size=4, kernel_size=3)
    caches = [make_cache(mode, spec, rocket) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)

    def qkv(n):
        return tuple(torch.randn(1, h, n, D, generator=gen) for h in (HKV * G, HKV, HKV))

    for cache in caches:  # the same length: the worst case, every layer of both at the same token
        cache.begin_forward(40, prefill=True, max_new=400)
        for layer in range(LAYERS):
            cache.attend(layer, *qkv(40), D**-0.5)
        cache.end_forward()

    def buffers():
        out = []
        for c in caches:
            for layer in range(LAYERS):
                out.append(c.layers[layer].buffers[0].data_ptr())
                kt = getattr(c.decode, "kt", [None] * LAYERS)[layer]
                out.append(kt.buffer.data_ptr() if kt is not None else 0)
        return out

    moves_per_step, moved = [], set()
    for _ in range(400):
        before = buffers()
        for c in caches:
            c.begin_forward(1, prefill=False)
        batch = BatchCache(caches, [1, 1])
        for layer in range(LAYERS):
            batch.attend(layer, *(torch.cat(x, dim=2) for x in zip(qkv(1), qkv(1))), D**-0.5)
        assert not batch.errors
        for c in caches:
            c.end_forward()
        changed = [i for i, (a, b) in enumerate(zip(before, buffers())) if a != b]
        moves_per_step.append(len(changed))
        moved.update(changed)
    stores = {i for i in range(0, 4 * LAYERS, 2)}
    assert stores <= moved  # every layer's store outgrew its buffer at least once
    # Both sessions are at the same length, so one layer of each moves in a step, not all eight (the
    # first step too: each layer's selection made the room its lead asks for).
    assert max(moves_per_step) <= 2, moves_per_step


@pytest.mark.skipif(not native_hsa.supports(torch.zeros(1)), reason="no C compiler")
def test_no_layer_grows_in_the_first_decode_step_when_its_lead_spans_many_small_pages():
    # A large budget over a long prompt gives small HSA pages (3 tokens here), so the last layers' leads
    # span more KT pages than a default spare; the selection leaves room for them all the same.
    spec = CacheSpec(LAYERS, HKV, D, torch.float32, torch.device("cpu"), kernels="native")
    cache = make_cache("rocketkv", spec, RocketKVConfig(token_budget=256, window_size=4, kernel_size=3))
    gen = torch.Generator().manual_seed(1)

    def qkv(n):
        return tuple(torch.randn(1, h, n, D, generator=gen) for h in (HKV * G, HKV, HKV))

    cache.begin_forward(1500, prefill=True, max_new=64)
    for layer in range(LAYERS):
        cache.attend(layer, *qkv(1500), D**-0.5)
    cache.end_forward()
    page = cache.split.page_size
    assert page <= 3 and cache._lead(LAYERS - 1) // page > KT_SPARE_PAGES

    def buffers():
        return [(cache.layers[layer].buffers[0].data_ptr(), cache.decode.kt[layer].buffer.data_ptr())
                for layer in range(LAYERS)]

    before = buffers()
    cache.begin_forward(1, prefill=False)
    batch = BatchCache([cache], [1])
    for layer in range(LAYERS):
        batch.attend(layer, *qkv(1), D**-0.5)
    assert not batch.errors
    cache.end_forward()
    assert buffers() == before


@pytest.mark.parametrize("page_size", [3, 4, 6])
def test_the_kt_bounds_of_many_layers_grow_on_different_steps(page_size):
    # 32 layers, leads spread over a store chunk (as ``ComposedCache._lead`` gives them): each layer's
    # bounds, prepared by HSA for its selection, first grow on a step of its own, none in the first.
    layers, kept = 32, 600
    spec = CacheSpec(layers, HKV, D, torch.float32, torch.device("cpu"), kernels="torch")
    split = BudgetSplit(token_budget=256, window_size=4, kernel_size=3, prompt_budget=kept, page_size=page_size,
                        topr=D, topk=64)
    decode = HSADecode(spec)
    grows_at = []
    for layer in range(layers):
        store = LayerKV(HKV, D, torch.float32, torch.device("cpu"))
        k = torch.randn(HKV, kept, D)
        store.append(k, k, torch.arange(kept))
        lead = store.chunk * layer // layers
        decode.prepare(layer, store, None, split, lead)
        kt = decode.kt[layer]
        for step in range(20 * store.chunk):
            capacity = kt.buffer.shape[2]
            kt.next_slot(lead // page_size)
            if kt.buffer.shape[2] != capacity:
                grows_at.append(step)
                break
            kt.appended()
    assert len(grows_at) == layers and min(grows_at) > 0
    assert len(set(grows_at)) == layers, grows_at
