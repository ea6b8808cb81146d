"""Every registered cache mode, driven with random attention inputs (no model): each is a composition
of a prefill and a decode policy, each is exact when nothing needs compressing, and each keeps its
history's positions straight when it compresses."""
import pytest
import torch

from cache_drive import SPEC, forward, layer_inputs, tier_context
from rocketkv_mt.cache import CACHE_MODES, cache_mode, make_cache
from rocketkv_mt.cache.policy import PrefillPolicy
from rocketkv_mt.config import RocketKVConfig

MODES = sorted(CACHE_MODES)


def test_every_mode_is_a_distinct_composition_of_the_two_policies():
    compositions = set()
    for name, mode in CACHE_MODES.items():
        assert mode.name == name
        assert PrefillPolicy in mode.prefill.__mro__, name  # its lifecycle hooks default to nothing
        for method in ("attend", "extend_decode_set", "bound", "decode_tokens"):
            assert callable(getattr(mode.prefill, method)), (name, method)
        for method in ("prepare", "attend", "nbytes", "bound"):
            assert callable(getattr(mode.decode, method)), (name, method)
        compositions.add((mode.prefill, mode.decode))
    assert len(compositions) == len(CACHE_MODES)  # no two names for one mode


def test_an_unknown_mode_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown cache mode 'dense'.*rocketkv-mt"):
        make_cache("dense", SPEC)
    with pytest.raises(ValueError):
        cache_mode("")


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_made_the_same_way_and_reports_its_name(mode):
    cache = make_cache(mode, SPEC, RocketKVConfig(token_budget=32), tiers=tier_context(session_id=f"made-{mode}"))
    assert cache.mode == mode
    assert cache.history_len == 0 and cache.kept_tokens() == 0 and cache.device_bytes() == 0
    assert cache.tier_bytes() == {"device": 0, "host": 0, "redis": 0}
    assert cache.persist() is None  # no Redis behind this host tier
    cache.release()


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_full_when_the_budget_holds_the_history(mode):
    gen_full, gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    rocket = RocketKVConfig(token_budget=4096, window_size=8, kernel_size=5)
    full = make_cache("full", SPEC, rocket)
    cache = make_cache(mode, SPEC, rocket, tiers=tier_context(session_id=f"exact-{mode}"))
    for n_new, max_new in ((90, 5), (30, 4)):
        turn_full, turn = layer_inputs(gen_full, n_new), layer_inputs(gen, n_new)
        for want, got in zip(forward(full, turn_full, prefill=True, max_new=max_new),
                             forward(cache, turn, prefill=True, max_new=max_new)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for _ in range(max_new - 1):
            step_full, step = layer_inputs(gen_full, 1), layer_inputs(gen, 1)
            for want, got in zip(forward(full, step_full, prefill=False), forward(cache, step, prefill=False)):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        cache.end_turn()
    assert cache.history_len == full.history_len
    assert cache.kept_tokens() == full.kept_tokens() == full.history_len  # nothing evicted
    assert cache.cold_tokens() == 0


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_keeps_positions_ascending_and_the_newest_tokens(mode):
    gen = torch.Generator().manual_seed(5)
    rocket = RocketKVConfig(token_budget=24, window_size=8, kernel_size=5)
    cache = make_cache(mode, SPEC, rocket, tiers=tier_context(session_id=f"order-{mode}"))
    for n_new, max_new in ((160, 6), (40, 6)):
        forward(cache, layer_inputs(gen, n_new), prefill=True, max_new=max_new)
        for _ in range(max_new):
            forward(cache, layer_inputs(gen, 1), prefill=False)
        cache.end_turn()
        # The observation window and every decode token stay on the device, at their true positions.
        newest = torch.arange(cache.history_len - max_new - rocket.window_size, cache.history_len)
        for store in cache.layers:
            pos = store.positions
            assert torch.all(pos[:, 1:] > pos[:, :-1])
            assert torch.equal(pos[:, -len(newest):], newest.expand(SPEC.num_kv_heads, -1))
            assert store.length <= cache.history_len
