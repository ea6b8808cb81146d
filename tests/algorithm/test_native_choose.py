"""The native Stage-1 choice over slots in any order against the torch path: the same slots, positions
and scores, bit for bit, ties and held positions included."""
import pytest
import torch

from rocketkv_mt import dispatch
from rocketkv_mt.native import stage1_choose as native
from rocketkv_mt.reselect import choose_over_parts

pytestmark = pytest.mark.skipif(not native.supports(torch.zeros(1)), reason="no C compiler: the kernel is not built")


def scattered(seed: int, hkv: int, history: int, w: int, device_n: int, cold_n: int, plateaus: bool):
    """Device slots holding the window and some history, cold slots some more (a few dead), each head
    its own positions, in no order; scores with exact ties when ``plateaus``."""
    gen = torch.Generator().manual_seed(seed)
    dev, cold = [], []
    for _ in range(hkv):
        perm = torch.randperm(history - w, generator=gen)
        dev.append(torch.cat([perm[:device_n], torch.arange(history - w, history)])[torch.randperm(device_n + w, generator=gen)])
        cold.append(perm[device_n : device_n + cold_n])
    device_pos, cold_pos = torch.stack(dev), torch.stack(cold)
    alive = torch.rand(hkv, cold_n, generator=gen) < 0.85
    cold_pos = torch.where(alive | (torch.rand(hkv, cold_n, generator=gen) < 0.5), cold_pos, -1)
    probs = torch.rand(hkv, device_pos.shape[1] + cold_n, generator=gen)
    if plateaus:
        probs = (probs * 4).floor() / 4  # few distinct values: the top-k cut falls inside a tie
    return probs, device_pos, cold_pos, alive


@pytest.mark.parametrize("kernel", [1, 4, 7, 63])
@pytest.mark.parametrize("plateaus", [False, True])
def test_native_choice_equals_the_torch_path(kernel, plateaus):
    for seed in range(4):
        probs, device_pos, cold_pos, alive = scattered(seed, 3, 700, 12, 150, 400, plateaus)
        args = (probs, device_pos, cold_pos, alive, 700, 12, 200, kernel)
        want = choose_over_parts(*args)
        got = dispatch.choose_over_parts(*args, backend="native")
        for g, x in zip(got, want):
            assert g.dtype == x.dtype and torch.equal(g, x)


def test_native_choice_keeps_only_what_every_head_holds():
    # Fewer positions held than the budget: every head keeps the fewest any head holds, plus the window.
    probs, device_pos, cold_pos, alive = scattered(9, 2, 400, 8, 20, 30, plateaus=False)
    args = (probs, device_pos, cold_pos, alive, 400, 8, 300, 5)
    want = choose_over_parts(*args)
    got = dispatch.choose_over_parts(*args, backend="native")
    assert want[0].shape[1] < 300 - 8 + 8
    for g, x in zip(got, want):
        assert torch.equal(g, x)


def test_native_choice_over_the_device_alone():
    probs, device_pos, _, _ = scattered(3, 2, 300, 6, 200, 0, plateaus=True)
    empty = torch.zeros(2, 0, dtype=torch.long)
    args = (probs[:, : device_pos.shape[1]], device_pos, empty, empty.bool(), 300, 6, 64, 7)
    for g, x in zip(dispatch.choose_over_parts(*args, backend="native"), choose_over_parts(*args)):
        assert torch.equal(g, x)


def test_native_choice_refuses_positions_outside_the_history_and_leaves_nan_to_torch():
    probs, device_pos, cold_pos, alive = scattered(1, 2, 300, 6, 100, 50, plateaus=False)
    bad = cold_pos.clone()
    bad[0, alive[0].nonzero()[0, 0]] = 300
    key_pos = torch.cat([device_pos, bad], dim=1)
    flags = torch.cat([torch.ones_like(device_pos, dtype=torch.bool), alive], dim=1)
    with pytest.raises(ValueError):
        native.choose(probs, key_pos, flags, 300, 6, 64, 7)
    with pytest.raises(ValueError):
        native.choose(probs, key_pos[:, 1:], flags, 300, 6, 64, 7)
    probs[0, 3] = float("nan")
    assert not native.supports(probs)  # the torch path's own NaN rule applies then


@pytest.mark.parametrize("with_dead", [False, True])
def test_native_reselect_equals_the_torch_path(with_dead):
    from rocketkv_mt.reselect import reselect

    gen = torch.Generator().manual_seed(21)
    hkv, group, w, d, history = 2, 3, 8, 16, 500
    q = torch.randn(hkv * group, w, d, generator=gen)
    keys = torch.randn(hkv, history, d, generator=gen)
    key_pos = torch.stack([torch.randperm(history, generator=gen) for _ in range(hkv)])
    alive = None
    if with_dead:
        alive = torch.rand(hkv, history, generator=gen) < 0.9
        alive |= key_pos >= history - w  # the window is always held
    args = (q, keys, key_pos, alive, history, 120, 7, d ** -0.5)
    for got, want in zip(dispatch.reselect(*args, backend="native"), reselect(*args)):
        assert torch.equal(got, want)
