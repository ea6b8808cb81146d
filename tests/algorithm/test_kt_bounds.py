"""The native KT page bounds equal the torch ones exactly, spare pages zero, on the views caches pass."""
import pytest
import torch

from rocketkv_mt.kt_cache import KTCache, bounds_buffer
from rocketkv_mt.native import available

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here")


@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("page", [1, 2, 3, 5])
@pytest.mark.parametrize("length", [0, 1, 7, 33, 650])
def test_native_bounds_equal_torch(d, page, length):
    g = torch.Generator().manual_seed(length * 7 + page)
    buf = torch.randn(3, length + 20, d, generator=g)
    keys = buf[:, :length]  # a layer store's kept tokens: a prefix of its buffer
    native = bounds_buffer(keys, page, 9, backend="native")
    reference = bounds_buffer(keys, page, 9, backend="torch")
    assert native.shape == reference.shape == (3, 2 * d, -(-length // page) + 9)
    assert torch.equal(native, reference)
    assert not native[:, :, -(-length // page):].any()  # spare pages zero


def test_a_cache_built_natively_grows_and_tightens_as_before():
    keys = torch.randn(2, 101, 64)
    a, b = KTCache(keys, 3, spare_pages=1, backend="native"), KTCache(keys, 3, spare_pages=1, backend="torch")
    for _ in range(8):  # past the spare page: both grow
        key = torch.randn(2, 64)
        a.append(key)
        b.append(key)
    assert (a.pages, a.length) == (b.pages, b.length) == (37, 109)
    assert torch.equal(a.bounds, b.bounds)


def test_native_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError):
        bounds_buffer(torch.randn(2, 8, 64, dtype=torch.bfloat16), 2, 4, backend="native")
    with pytest.raises(RuntimeError):
        bounds_buffer(torch.randn(2, 64, 8).transpose(1, 2), 2, 4, backend="native")  # rows not contiguous
    keys = torch.randn(2, 8, 64, dtype=torch.bfloat16)  # auto: torch takes it
    assert bounds_buffer(keys, 2, 4).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_new_decode_set_writes_over_the_old_buffer_where_it_fits(backend):
    g = torch.Generator().manual_seed(11)
    first = KTCache(torch.randn(3, 300, 64, generator=g), 2, spare_pages=8, backend=backend)  # 150 + 8 pages
    keys = torch.randn(3, 311, 64, generator=g)
    # 156 pages and half the 8 spare ones do not fit 158: a new buffer.
    second = KTCache(keys, 2, spare_pages=8, backend=backend, reuse=first)
    assert second.buffer.data_ptr() != first.buffer.data_ptr() and second.buffer.shape[2] == 156 + 8
    for _ in range(5):
        second.append(keys[:, -1])  # the old cache's spare pages hold something now
    for length in (318, 280):  # 159 + 4 pages fit 164, and fewer
        shorter = torch.randn(3, length, 64, generator=g)
        third = KTCache(shorter, 2, spare_pages=8, backend=backend, reuse=second)
        assert third.buffer.data_ptr() == second.buffer.data_ptr()  # written over in place
        assert torch.equal(third.bounds, KTCache(shorter, 2, backend="torch").bounds)
        assert not third.buffer[:, :, third.pages:].any()  # every page past them zero again
        for _ in range(2 * (third.buffer.shape[2] - third.pages) + 1):
            third.append(shorter[:, 0])  # past its spare pages: it grows, as a fresh one does
        assert third.buffer.data_ptr() != second.buffer.data_ptr()
        second = KTCache(shorter, 2, spare_pages=8, backend=backend)
