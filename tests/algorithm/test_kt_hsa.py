"""KT min/max pages and HSA page selection against loop references."""
import math

import pytest
import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.hsa import hsa_attention, page_scores, page_tokens, select_channels, select_pages, sparse_attention
from rocketkv_mt.kt_cache import KTCache, page_minmax


@pytest.mark.parametrize("length,page", [(10, 3), (12, 4), (7, 1), (5, 8)])
def test_page_minmax_matches_loops(length, page):
    torch.manual_seed(0)
    keys = torch.randn(3, length, 6)
    kmin, kmax = page_minmax(keys, page)
    assert kmin.shape == (3, math.ceil(length / page), 6)
    for h in range(3):
        for p in range(kmin.shape[1]):
            chunk = keys[h, p * page:(p + 1) * page]
            assert torch.equal(kmin[h, p], chunk.min(0).values)
            assert torch.equal(kmax[h, p], chunk.max(0).values)


@pytest.mark.parametrize("page", [1, 3, 4])
def test_decode_appends_update_last_page_in_place(page):
    torch.manual_seed(1)
    keys = torch.randn(2, 11, 5)
    kt = KTCache(keys[:, :4], page, spare_pages=1)
    for t in range(4, 11):
        kt.append(keys[:, t])
    kmin, kmax = page_minmax(keys, page)
    assert torch.equal(kt.kmin, kmin) and torch.equal(kt.kmax, kmax)
    # Its bytes are those of the pages in use, not of the spare ones it grew into.
    assert kt.nbytes() == kt.bounds.numel() * 4 == 2 * 2 * 5 * kmin.shape[1] * 4 < kt.buffer.numel() * 4


def reference_page_scores(q, kmin, kmax, topr):
    hkv, g, d = q.shape
    out = torch.zeros(hkv, kmin.shape[1], dtype=torch.float64)
    for h in range(hkv):
        mag = [sum(abs(float(q[h, j, c])) for j in range(g)) for c in range(d)]
        chans = sorted(range(d), key=lambda c: -mag[c])[:topr]
        for j in range(g):
            qh = q[h, j].double()
            scale = math.sqrt(d * sum(abs(float(qh[c])) for c in chans) / float(qh.abs().sum()))
            logits = []
            for p in range(kmin.shape[1]):
                s = 0.0
                for c in chans:
                    bound = kmax[h, p, c] if float(q[h, :, c].sum()) > 0 else kmin[h, p, c]
                    s += float(qh[c]) * float(bound)
                logits.append(s / scale)
            out[h] += torch.softmax(torch.tensor(logits, dtype=torch.float64), 0) / g
    return out


@pytest.mark.parametrize("group", [1, 3, 4])
def test_page_scores_and_selection_match_reference(group):
    torch.manual_seed(group)
    hkv, d, length, page, topr = 2, 16, 37, 3, 6
    q = torch.randn(hkv, group, d, dtype=torch.float64)
    keys = torch.randn(hkv, length, d, dtype=torch.float64)
    kmin, kmax = page_minmax(keys, page)
    scores = page_scores(q, kmin, kmax, select_channels(q, topr))
    ref = reference_page_scores(q, kmin, kmax, topr)
    assert torch.allclose(scores.double(), ref, atol=1e-6)
    pages = select_pages(scores, 4)
    for h in range(hkv):
        want = sorted(sorted(range(ref.shape[1]), key=lambda p: -float(ref[h, p]))[:4])
        assert pages[h].tolist() == want


def test_sparse_attention_equals_dense_over_gathered_tokens():
    torch.manual_seed(5)
    hkv, g, d, length, page = 2, 3, 8, 20, 3
    q = torch.randn(hkv, g, d)
    keys, values = torch.randn(hkv, length, d), torch.randn(hkv, length, d)
    pages = torch.tensor([[0, 6], [2, 5]])  # page 6 is the partial last page (tokens 18, 19)
    tokens, valid = page_tokens(pages, page, length)
    out = sparse_attention(q, keys, values, tokens, valid, d ** -0.5)
    for h in range(hkv):
        idx = tokens[h][valid[h]]
        ref = torch.softmax(q[h] @ keys[h, idx].T * d ** -0.5, -1) @ values[h, idx]
        assert torch.allclose(out[h], ref, atol=1e-5)


def test_hsa_with_every_page_selected_is_exact_attention():
    torch.manual_seed(6)
    hkv, g, d, length, page = 3, 3, 16, 50, 4
    q = torch.randn(hkv, g, d)
    keys, values = torch.randn(hkv, length, d), torch.randn(hkv, length, d)
    kmin, kmax = page_minmax(keys, page)
    out = hsa_attention(q, keys, values, kmin, kmax, page, 8, length, d ** -0.5)
    ref = dense_attention(q.reshape(hkv * g, 1, d), keys, values, d ** -0.5).reshape(hkv, g, d)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("group,page,length,local", [(1, 1, 40, 0), (3, 3, 100, 0), (4, 4, 98, 0), (3, 5, 131, 0), (3, 3, 100, 8), (4, 4, 98, 11)])
def test_fast_decode_path_equals_reference(group, page, length, local):
    from rocketkv_mt.cache.store import LayerKV
    from rocketkv_mt.hsa import hsa_decode

    torch.manual_seed(page)
    hkv, d = 3, 32
    store = LayerKV(hkv, d, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(hkv, length, d), torch.randn(hkv, length, d)
    store.append(keys[:, :-5], values[:, :-5], torch.arange(length - 5))
    kt = KTCache(store.keys, page)
    for t in range(length - 5, length):  # decode appends, the last page possibly partial
        store.append(keys[:, t:t + 1], values[:, t:t + 1], torch.tensor([t]))
        kt.append(keys[:, t])
    assert store.nbytes() == 2 * store.keys.numel() * 4 == 2 * hkv * length * d * 4  # kept tokens, not capacity
    q = torch.randn(hkv, group, d)
    kb, vb = store.buffers
    got = hsa_decode(q, kb, vb, length, kt.bounds, page, 8, 24, d ** -0.5, local)
    ref = hsa_attention(q, keys, values, kt.kmin, kt.kmax, page, 8, 24, d ** -0.5, local_window=local)
    assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("length,page,window,expected", [(100, 3, 8, 4), (99, 3, 9, 3), (100, 4, 11, 3), (10, 3, 32, 4), (50, 5, 0, 0)])
def test_local_pages_cover_exactly_the_last_window(length, page, window, expected):
    from rocketkv_mt.hsa import local_pages

    n = local_pages(length, page, window)
    assert n == expected
    pages = -(-length // page)
    if window:  # the first local page holds token length - window; the page before it does not
        assert (pages - n) * page <= max(0, length - window) < (pages - n + 1) * page


def test_local_window_pages_always_selected_within_k():
    torch.manual_seed(0)
    scores = torch.rand(3, 20)
    scores[:, -4:] = -1.0  # the recent pages score lowest, yet must be chosen
    pages = select_pages(scores, 6, n_local=3)
    assert pages.shape == (3, 6)
    for h in range(3):
        assert {17, 18, 19} <= set(pages[h].tolist())
        best_rest = torch.topk(scores[h, :17], 3).indices.tolist()
        assert set(pages[h].tolist()) == {17, 18, 19, *best_rest}


@pytest.mark.parametrize("length,page,n", [(30, 3, 4), (31, 4, 3), (10, 5, 9)])
def test_anchor_pages_are_the_pages_with_the_best_token(length, page, n):
    from rocketkv_mt.anchors import anchor_pages

    torch.manual_seed(length)
    scores = torch.rand(2, length)
    got = anchor_pages(scores, page, n)
    pages = -(-length // page)
    for h in range(2):
        best = [max(scores[h, p * page:(p + 1) * page].tolist()) for p in range(pages)]
        want = sorted(sorted(range(pages), key=lambda p: -best[p])[: min(n, pages)])
        assert got[h].tolist() == want
    assert anchor_pages(scores, page, 0) is None


def test_pinned_pages_are_attended_and_fast_path_agrees():
    from rocketkv_mt.cache.store import LayerKV
    from rocketkv_mt.hsa import hsa_decode

    torch.manual_seed(5)
    hkv, g, d, length, page = 3, 3, 32, 120, 3
    store = LayerKV(hkv, d, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(hkv, length, d), torch.randn(hkv, length, d)
    store.append(keys, values, torch.arange(length))
    kt = KTCache(store.keys, page)
    q = torch.randn(hkv, g, d)
    channels = select_channels(q, 8)
    scores = page_scores(q, kt.kmin, kt.kmax, channels)
    pinned = torch.argsort(scores, dim=-1)[:, :2].sort(dim=-1).values  # the two worst pages per head
    chosen = select_pages(scores, 8, n_local=2, pinned=pinned)
    for h in range(hkv):
        assert set(pinned[h].tolist()) <= set(chosen[h].tolist())
        assert {38, 39} <= set(chosen[h].tolist())
    kb, vb = store.buffers
    got = hsa_decode(q, kb, vb, length, kt.bounds, page, 8, 24, d ** -0.5, 4, pinned)
    ref = hsa_attention(q, keys, values, kt.kmin, kt.kmax, page, 8, 24, d ** -0.5, local_window=4, pinned=pinned)
    assert torch.allclose(got, ref, atol=1e-5)
    plain = hsa_attention(q, keys, values, kt.kmin, kt.kmax, page, 8, 24, d ** -0.5)
    assert not torch.allclose(ref, plain, atol=1e-5)  # pinning the worst pages changes what is attended
