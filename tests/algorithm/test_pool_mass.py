"""The window mass of a pool of sketched tokens (``rocketkv_mt.pool_mass``): the torch path and the
native kernel against the softmax over the device and the pool, computed in float64."""
import math

import pytest
import torch

from rocketkv_mt import dispatch
from rocketkv_mt.native import pool_mass as native
from rocketkv_mt.pool_mass import FLOOR


def case(seed: int, hkv: int = 3, rows: int = 10, m: int = 77, spread: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(hkv, rows, m, generator=gen) * spread
    alive = torch.rand(hkv, m, generator=gen) < 0.8
    alive[-1, :] = False  # a head whose pool is all padding
    # Each row's normaliser over the device keys: at least its own token's logit, here near the pool's.
    lse_dev = torch.randn(hkv, rows, generator=gen) * spread + spread
    return logits, alive, lse_dev


def reference(logits, alive, lse_dev):
    x = logits.double().masked_fill(~alive.unsqueeze(1), float("-inf"))
    lse = torch.logaddexp(lse_dev.double(), torch.logsumexp(x, dim=-1))
    return lse, torch.exp(x - lse.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_mass_is_the_softmax_over_the_device_and_the_alive_pool(backend, dtype):
    if backend == "native" and not native.supports(torch.zeros(1)):
        pytest.skip("no C compiler: the native kernel is not built here")
    logits, alive, lse_dev = case(seed=3)
    logits = logits.to(dtype)
    before = torch.rand(alive.shape)  # the mass is added to: chunks of rows accumulate into one tensor
    mass = before.clone()
    lse = dispatch.pool_mass(logits, alive, lse_dev, mass, backend=backend)
    want_lse, want_mass = reference(logits, alive, lse_dev)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-5)
    # A share below exp(FLOOR) of the device's mass is floored there: each row adds at most that much.
    slack = logits.shape[1] * math.exp(FLOOR)
    added = (mass - before).double()
    assert (added[~alive] == 0).all()
    assert ((added - want_mass).abs() <= 2e-5 * want_mass + slack + 2e-6).all()


def test_native_pool_mass_equals_the_torch_path_row_chunk_by_row_chunk():
    if not native.supports(torch.zeros(1)):
        pytest.skip("no C compiler: the native kernel is not built here")
    logits, alive, lse_dev = case(seed=5, rows=13, m=300, spread=6.0)
    mass_t, mass_n = torch.zeros(alive.shape), torch.zeros(alive.shape)
    for rows in (slice(0, 7), slice(7, 13)):
        lse_t = dispatch.pool_mass(logits[:, rows], alive, lse_dev[:, rows], mass_t, backend="torch")
        lse_n = dispatch.pool_mass(logits[:, rows], alive, lse_dev[:, rows], mass_n, backend="native")
        torch.testing.assert_close(lse_n, lse_t, rtol=0, atol=2e-6)
    torch.testing.assert_close(mass_n, mass_t, rtol=2e-5, atol=1e-12)


def test_native_pool_mass_refuses_what_it_would_read_out_of_bounds():
    if not native.supports(torch.zeros(1)):
        pytest.skip("no C compiler: the native kernel is not built here")
    logits, alive, lse_dev = case(seed=7)
    mass = torch.zeros(alive.shape)
    with pytest.raises(ValueError):
        native.pool_mass(logits, alive[:, :-1], lse_dev, mass)
    with pytest.raises(ValueError):
        native.pool_mass(logits, alive, lse_dev[:, :-1], mass)
    with pytest.raises(ValueError):
        native.pool_mass(logits, alive, lse_dev, mass.double())
    with pytest.raises(ValueError):
        native.pool_mass(logits, alive, lse_dev, torch.zeros(alive.shape[1], alive.shape[0]).T)
    assert not native.supports(logits.half())
