"""Triton kernels against their torch references.

On a CPU machine the kernels run under the Triton interpreter (``kernel_helpers.load_kernels`` sets
TRITON_INTERPRET before the kernels are first imported); on a GPU machine they are compiled for CUDA
(``make gpu-check`` runs this file there with TRITON_INTERPRET=0).
"""
import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import kernel_device, load_kernels  # noqa: E402
from rocketkv_mt import dispatch, hsa, stage1  # noqa: E402
from rocketkv_mt.kt_cache import page_minmax  # noqa: E402

K = load_kernels()
if K is None:
    pytest.skip("kernels built for a GPU but no CUDA here: run with TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = kernel_device(K)

pytestmark = pytest.mark.kernel

# (G, d, page_size, L, r): GQA ratios 1/3/4/8, head dims 64/128, lengths off the page and block sizes.
SHAPES = [(1, 64, 1, 300, 64), (3, 128, 3, 100, 20), (4, 64, 7, 150, 16), (8, 128, 16, 201, 100)]
DTYPES = [torch.float32, torch.bfloat16]
HKV = 2


def _ids(shape):
    return "G{}-d{}-ps{}-L{}-r{}".format(*shape)


def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def _close(actual, expected, dtype):
    # bf16 outputs differ from the reference by its final rounding (GPU: also p cast to bf16 before P@V).
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def _page_case(shape, dtype, seed=0):
    g, d, ps, length, r = shape
    gen = torch.Generator().manual_seed(seed)
    q = _rand(gen, HKV, g, d, dtype=dtype)
    keys = _rand(gen, HKV, length, d, dtype=dtype)
    values = _rand(gen, HKV, length, d, dtype=dtype)
    kmin, kmax = page_minmax(keys, ps)
    return q, keys, values, kmin, kmax, hsa.select_channels(q, r)


def _selected_tokens(q, kmin, kmax, channels, ps, length, n_tokens=100):
    scores = hsa.page_scores(q, kmin, kmax, channels)
    pages = hsa.select_pages(scores, math.ceil(n_tokens / ps))  # default: several 64-token blocks
    return hsa.page_tokens(pages, ps, length)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_page_scores_kernel_matches_reference(shape, dtype):
    q, _, _, kmin, kmax, channels = _page_case(shape, dtype)
    got = K.page_scores(q, kmin, kmax, channels)
    want = hsa.page_scores(q, kmin, kmax, channels)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got.sum(-1), torch.ones(HKV, device=DEVICE))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_sparse_decode_kernel_matches_reference(shape, dtype, splits):
    g, d, ps, length, _ = shape
    q, keys, values, kmin, kmax, channels = _page_case(shape, dtype, seed=1)
    tokens, valid = _selected_tokens(q, kmin, kmax, channels, ps, length)
    got = K.sparse_attention(q, keys, values, tokens, valid, d**-0.5, splits=splits)
    want = hsa.sparse_attention(q, keys, values, tokens, valid, d**-0.5)
    assert got.dtype == dtype and got.shape == (HKV, g, d)
    _close(got, want, dtype)


def test_sparse_decode_kernel_never_reads_invalid_tokens():
    gen = torch.Generator().manual_seed(2)
    g, d, length, t = 4, 64, 90, 130
    q, keys, values = _rand(gen, HKV, g, d), _rand(gen, HKV, length, d), _rand(gen, HKV, length, d)
    tokens = torch.randint(0, length, (HKV, t), generator=gen).to(DEVICE)
    valid = (torch.rand(HKV, t, generator=gen) < 0.6).to(DEVICE)
    valid[:, 0] = True
    wild = torch.where(valid, tokens, torch.full_like(tokens, 10**9))  # would fault if dereferenced
    got = K.sparse_attention(q, keys, values, wild.to(torch.int32), valid, d**-0.5, splits=2)
    _close(got, hsa.sparse_attention(q, keys, values, tokens, valid, d**-0.5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_sparse_decode_kernel_matches_per_session_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    bsz, g, d, ps, cap = 3, 4, 128, 3, 160
    lengths = [150, 77, 121]
    lmax = max(lengths)
    # Slices of a larger preallocated buffer (non-contiguous); rows past each length are NaN poison.
    kbuf = _rand(gen, bsz, HKV, cap, d, dtype=dtype)
    vbuf = _rand(gen, bsz, HKV, cap, d, dtype=dtype)
    q = _rand(gen, bsz, HKV, g, d, dtype=dtype)
    for b, n in enumerate(lengths):
        kbuf[b, :, n:] = float("nan")
        vbuf[b, :, n:] = float("nan")
    keys, values = kbuf[:, :, :lmax], vbuf[:, :, :lmax]
    per_session, tokens, valid = [], [], []
    for b, n in enumerate(lengths):
        kmin, kmax = page_minmax(keys[b, :, :n], ps)
        tok, ok = _selected_tokens(q[b], kmin, kmax, hsa.select_channels(q[b], 32), ps, n, n_tokens=75)
        tokens.append(tok)
        valid.append(ok)
        per_session.append(hsa.sparse_attention(q[b], keys[b, :, :n], values[b, :, :n], tok, ok, d**-0.5))
    tokens, valid = torch.stack(tokens), torch.stack(valid)
    got = K.sparse_attention_batched(q, keys, values, tokens, valid, d**-0.5)
    _close(got, torch.stack(per_session), dtype)
    _close(dispatch.sparse_attention_batched(q, keys, values, tokens, valid, d**-0.5, backend="torch"), got, dtype)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g,d,w,length", [(1, 64, 4, 37), (3, 128, 8, 100), (4, 64, 32, 77), (8, 128, 5, 150)])
def test_window_scores_kernel_matches_reference(g, d, w, length, dtype, splits):
    gen = torch.Generator().manual_seed(4)
    q_win = _rand(gen, HKV * g, w, d, dtype=dtype)
    keys = _rand(gen, HKV, length, d, dtype=dtype)
    got = K.window_scores(q_win, keys, d**-0.5, splits=splits)
    want = stage1.window_scores(q_win, keys, d**-0.5)
    assert got.shape == (HKV, length - w) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_dispatch_kernel_backends():
    q, keys, values, kmin, kmax, channels = _page_case(SHAPES[2], torch.float32, seed=5)
    scale = keys.shape[-1] ** -0.5
    tokens, valid = _selected_tokens(q, kmin, kmax, channels, SHAPES[2][2], keys.shape[1])
    q_win = q.reshape(HKV * q.shape[1], 1, -1).expand(-1, 6, -1).contiguous()
    calls = [
        (dispatch.page_scores, hsa.page_scores, K.page_scores, (q, kmin, kmax, channels)),
        (dispatch.sparse_attention, hsa.sparse_attention, K.sparse_attention, (q, keys, values, tokens, valid, scale)),
        (dispatch.window_scores, stage1.window_scores, K.window_scores, (q_win, keys, scale)),
    ]
    for routed, reference, kernel, args in calls:
        assert torch.equal(routed(*args, backend="torch"), reference(*args))
        assert torch.equal(routed(*args, backend="triton"), kernel(*args))
        auto = reference if DEVICE == "cpu" else kernel
        assert torch.equal(routed(*args), auto(*args))
        with pytest.raises(ValueError):
            routed(*args, backend="cuda")
    assert dispatch.window_scores(q_win, keys[:, :6], scale, backend="triton").shape == (HKV, 0)


@pytest.mark.kernel
def test_kernel_dispatched_hsa_attention_matches_reference():
    from rocketkv_mt import dispatch
    from rocketkv_mt.hsa import hsa_attention
    from rocketkv_mt.kt_cache import page_minmax

    torch.manual_seed(11)
    hkv, g, d, length, page = 2, 4, 64, 77, 3
    q = torch.randn(hkv, g, d, device=DEVICE)
    keys, values = torch.randn(hkv, length, d, device=DEVICE), torch.randn(hkv, length, d, device=DEVICE)
    kmin, kmax = page_minmax(keys, page)
    ref = hsa_attention(q, keys, values, kmin, kmax, page, 16, 24, d ** -0.5)
    got = dispatch.hsa_attention(q, keys, values, kmin, kmax, page, 16, 24, d ** -0.5, backend="triton")
    assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.kernel
def test_kernel_dispatched_hsa_decode_reads_the_cache_buffers_like_the_torch_path():
    from rocketkv_mt.cache.store import LayerKV
    from rocketkv_mt.kt_cache import KTCache

    torch.manual_seed(12)
    hkv, g, d, length, page = 2, 4, 64, 80, 3
    store = LayerKV(hkv, d, torch.float32, torch.device(DEVICE))
    store.append(torch.randn(hkv, length, d), torch.randn(hkv, length, d), torch.arange(length))
    kt = KTCache(store.keys, page)
    kb, vb = store.buffers
    q = torch.randn(hkv, g, d, device=DEVICE)
    args = (q, kb, vb, length, kt.bounds, page, 16, 24, d ** -0.5)
    ref = hsa.hsa_decode(*args, 8)
    got = dispatch.hsa_decode(*args, local_window=8, backend="triton")
    assert torch.allclose(got, ref, atol=1e-4)
