"""The native CPU HSA kernel against the torch path and the reference it is held to."""
from __future__ import annotations

import shutil

import pytest
import torch

from rocketkv_mt import dispatch
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.hsa import hsa_attention, hsa_decode, local_pages
from rocketkv_mt.kt_cache import KTCache

native = pytest.importorskip("rocketkv_mt.native.hsa")


def _built() -> bool:
    # Where a C compiler exists the kernel must build: a failed build is a bug, not a skip.
    if shutil.which("cc") or shutil.which("gcc"):
        assert native.supports(torch.zeros(1)), "a C compiler is present but the native kernel did not build"
        return True
    return False


pytestmark = pytest.mark.skipif(not _built(), reason="no C compiler on this machine")


def _layer(hkv, d, length, page, decoded=5, seed=0):
    torch.manual_seed(seed)
    store = LayerKV(hkv, d, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(hkv, length, d), torch.randn(hkv, length, d)
    store.append(keys[:, : length - decoded], values[:, : length - decoded], torch.arange(length - decoded))
    kt = KTCache(store.keys, page)
    for t in range(length - decoded, length):  # decode appends: the last page may be partial
        store.append(keys[:, t:t + 1], values[:, t:t + 1], torch.tensor([t]))
        kt.append(keys[:, t])
    return store, kt, keys, values


@pytest.mark.parametrize(
    "hkv,group,d,page,length,topr,topk,local",
    [(3, 1, 32, 1, 40, 8, 24, 0), (3, 3, 64, 3, 1442, 34, 128, 32), (2, 4, 32, 4, 98, 8, 24, 11),
     (3, 3, 32, 5, 131, 8, 24, 0), (1, 3, 64, 3, 600, 64, 90, 32), (3, 3, 32, 3, 20, 8, 300, 4)],
)
def test_native_equals_torch_path_and_reference(hkv, group, d, page, length, topr, topk, local):
    store, kt, keys, values = _layer(hkv, d, length, page, seed=length)
    q = torch.randn(hkv, group, d)
    kb, vb = store.buffers
    args = (q, kb, vb, length, kt.bounds, page, topr, topk, d ** -0.5, local)
    got = native.hsa_decode(*args)
    assert torch.allclose(got, hsa_decode(*args), atol=1e-5)
    ref = hsa_attention(q, keys, values, kt.kmin, kt.kmax, page, topr, topk, d ** -0.5, local_window=local)
    assert torch.allclose(got, ref, atol=1e-5)


def test_native_attends_pinned_pages():
    store, kt, keys, values = _layer(3, 32, 120, 3, decoded=0, seed=5)
    q = torch.randn(3, 3, 32)
    pinned = torch.tensor([[0, 7], [3, 30], [1, 2]])
    kb, vb = store.buffers
    got = native.hsa_decode(q, kb, vb, 120, kt.bounds, 3, 8, 24, 32 ** -0.5, 4, pinned)
    ref = hsa_attention(q, keys, values, kt.kmin, kt.kmax, 3, 8, 24, 32 ** -0.5, local_window=4, pinned=pinned)
    plain = hsa_attention(q, keys, values, kt.kmin, kt.kmax, 3, 8, 24, 32 ** -0.5, local_window=4)
    assert torch.allclose(got, ref, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-5)


def test_dispatch_routes_by_backend():
    store, kt, _, _ = _layer(3, 32, 90, 3)
    q = torch.randn(3, 3, 32)
    kb, vb = store.buffers
    args = (q, kb, vb, 90, kt.bounds, 3, 8, 24, 32 ** -0.5)
    for backend in ("auto", "native", "torch"):
        assert torch.allclose(dispatch.hsa_decode(*args, backend=backend), hsa_decode(*args), atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        dispatch.hsa_decode(q.double(), kb.double(), vb.double(), 90, kt.bounds.double(), 3, 8, 24, 0.1, backend="native")


def test_native_rejects_what_it_would_read_out_of_bounds():
    store, kt, _, _ = _layer(3, 32, 60, 3)
    kb, vb = store.buffers
    q = torch.randn(3, 3, 32)
    args = (q, kb, vb, 60, kt.bounds, 3, 8, 24, 0.2)
    assert native.hsa_decode(*args).shape == (3, 3, 32)
    strided = kb.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        native.hsa_decode(q, strided, vb, 60, kt.bounds, 3, 8, 24, 0.2)
    with pytest.raises(ValueError, match="cover"):
        native.hsa_decode(q, kb, vb, 61, kt.bounds, 3, 8, 24, 0.2)  # one token more than the pages hold
    with pytest.raises(ValueError, match="length"):
        native.hsa_decode(q, kb, vb, kb.shape[1] + 1, kt.bounds, 3, 8, 24, 0.2)
    with pytest.raises(ValueError, match="pinned"):
        native.hsa_decode(*args, 4, torch.tensor([[0], [1], [20]]))  # page 20 of 20 does not exist
    with pytest.raises(ValueError, match="float32"):
        native.hsa_decode(q, kb.half(), vb.half(), 60, kt.bounds, 3, 8, 24, 0.2)
    with pytest.raises(ValueError, match="match"):
        native.hsa_decode(torch.randn(2, 3, 32), kb, vb, 60, kt.bounds, 3, 8, 24, 0.2)


def test_pages_scored_alike_are_taken_in_page_order_up_to_the_budget():
    # Every key alike: every page scores the same, so the budget's unforced pages are a tie. The kernel
    # takes the last (local) pages and then the first pages in order; with equal keys attention is
    # uniform over what it took, so the output is the mean of exactly those values.
    hkv, d, page, length, topk, local = 2, 32, 3, 60, 24, 4
    torch.manual_seed(3)
    store = LayerKV(hkv, d, torch.float32, torch.device("cpu"))
    keys = torch.randn(hkv, 1, d).expand(hkv, length, d).contiguous()
    values = torch.randn(hkv, length, d)
    store.append(keys, values, torch.arange(length))
    kt = KTCache(store.keys, page)
    kb, vb = store.buffers
    q = torch.randn(hkv, 3, d)
    got = native.hsa_decode(q, kb, vb, length, kt.bounds, page, 8, topk, d ** -0.5, local)
    n_local = local_pages(length, page, local)
    room = topk // page - n_local
    pages = list(range(room)) + list(range(length // page - n_local, length // page))
    tokens = torch.tensor([p * page + i for p in pages for i in range(page)])
    expected = values[:, tokens].mean(dim=1, keepdim=True).expand(hkv, 3, d)
    assert torch.allclose(got, expected, atol=1e-5)
