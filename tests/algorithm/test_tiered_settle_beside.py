"""A layer read whole chooses and applies its selection (promote, demote, the decode set) on the page
reader while the model thread goes on with the next layer, whose pages the reader has read meanwhile;
selection, outputs and cold tier come out exactly as when all of it runs inline, and a step that
fails leaves nothing running on the reader."""
import threading
import time

import pytest
import torch

from rocketkv_mt.cache.prefill.tiered import ReselectTiered
from cache_drive import SPEC, forward, layer_inputs, three_turns
from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.cold.layer import ColdLayer
from tiers.host.tier import HostTier
from tiers.transfers import Transfers

# Every layer's cold set is small enough to be read whole.
POLICY = TierPolicy(page_tokens=8, read_whole=1000)
ROCKET = RocketKVConfig(token_budget=32, window_size=8, kernel_size=5)


def threads_of(monkeypatch, method: str) -> list[tuple[int, str]]:
    """(layer, thread name) of every call of ``ColdLayer.<method>`` from now on."""
    calls = []
    original = getattr(ColdLayer, method)

    def recorded(self, *args, **kwargs):
        calls.append((self.layer, threading.current_thread().name))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ColdLayer, method, recorded)
    return calls


def let_the_reader_begin(monkeypatch) -> None:
    """Waits for a job on the reader let it begin there first (a waiter otherwise runs a job the reader
    has not begun itself: with these small shapes, often before the reader thread wakes)."""
    wait = Transfers.wait

    def patient(self, fut):
        while not (fut.running() or fut.done()):
            time.sleep(0.0005)
        return wait(self, fut)

    monkeypatch.setattr(Transfers, "wait", patient)


def tiered_cache(name: str, reader: Transfers | None):
    """A tiered cache of ``POLICY`` on a host tier of its own, its reads on ``reader`` (None: inline)."""
    return make_cache("tiered", SPEC, ROCKET, tiers=TierContext(HostTier(64 << 20, None), name, POLICY, transfers=reader))


def test_a_layer_read_whole_is_applied_on_the_page_reader_as_it_is_inline(monkeypatch):
    demotes = threads_of(monkeypatch, "stage_demotion")
    let_the_reader_begin(monkeypatch)
    transfers = Transfers(torch.device("cpu"))
    try:
        runs = []
        for reader in (None, transfers):
            cache = tiered_cache(f"settle-{reader is not None}", reader)
            demotes.clear()
            runs.append((three_turns(cache, seed=5), list(demotes), cache.tier_bytes()))
            assert cache.cold_tokens() > 0
        (inline, inline_demotes, inline_bytes), (beside, beside_demotes, beside_bytes) = runs
        assert not any(name.startswith("rkv-pages") for _, name in inline_demotes)
        # The two short turns: every layer but the last demoted on the reader, the last one here.
        on_reader = [layer for layer, name in beside_demotes if name.startswith("rkv-pages")]
        assert sorted(on_reader) == sorted(list(range(SPEC.num_layers - 1)) * 2)
        last = [name for layer, name in beside_demotes if layer == SPEC.num_layers - 1]
        assert last and not any(name.startswith("rkv-pages") for name in last)
        for a, b in zip(inline[0], beside[0], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(inline[1], beside[1], strict=True):
            assert torch.equal(a, b)
        assert inline_bytes == beside_bytes
    finally:
        transfers.close()


def test_a_step_that_fails_after_a_layer_went_to_the_reader_leaves_nothing_running(monkeypatch):
    transfers = Transfers(torch.device("cpu"))
    started, release = threading.Event(), threading.Event()
    reorganise = ReselectTiered._reorganise

    def slow_first_layer(self, layer, *args):
        if layer == 0 and threading.current_thread().name.startswith("rkv-pages"):
            started.set()
            assert release.wait(5)
            raise RuntimeError("demotion failed")
        return reorganise(self, layer, *args)

    try:
        cache = tiered_cache("settle-fails", transfers)
        gen = torch.Generator().manual_seed(7)
        forward(cache, layer_inputs(gen, 200), prefill=True)
        cache.end_turn()
        monkeypatch.setattr(ReselectTiered, "_reorganise", slow_first_layer)
        inputs = layer_inputs(gen, 12)
        cache.begin_forward(12, prefill=True)
        cache.attend(0, *inputs[0], SPEC.head_dim ** -0.5)
        assert started.wait(5)
        pending = cache.prefill._pending[0]
        assert not pending.future.done()  # layer 0 is being applied while this thread may go on
        release.set()
        with pytest.raises(RuntimeError, match="demotion failed"):
            cache.attend(1, *inputs[1], SPEC.head_dim ** -0.5)  # the next layer waits for it, and fails
        cache.release()
        assert pending.future.done() and all(p is None for p in cache.prefill._pending)
        assert all(r is None for r in cache.prefill.reads._reads)  # layer 1's read, started beside layer 0, ended
    finally:
        transfers.close()


def test_the_next_layer_read_whole_is_read_on_the_page_reader(monkeypatch):
    fetches = threads_of(monkeypatch, "fetch")
    transfers = Transfers(torch.device("cpu"))
    try:
        outs = []
        for reader in (None, transfers):
            cache = tiered_cache(f"read-beside-{reader is not None}", reader)
            gen = torch.Generator().manual_seed(9)
            forward(cache, layer_inputs(gen, 200), prefill=True)
            cache.end_turn()
            fetches.clear()
            # A turn of no more rows than the window: nothing else to overlap, so the first layer's
            # read stays on this thread; every later layer's was started beside the layer before it.
            outs.append(forward(cache, layer_inputs(gen, 6), prefill=True, max_new=2))
            on_reader = sorted(layer for layer, name in fetches if name.startswith("rkv-pages"))
            here = [layer for layer, name in fetches if not name.startswith("rkv-pages")]
            if reader is not None:
                assert on_reader == list(range(1, SPEC.num_layers)) and here == [0]
                assert all(r is None for r in cache.prefill.reads._reads)  # each handed over to its layer
            else:
                assert here == list(range(SPEC.num_layers))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
    finally:
        transfers.close()
