"""The native causal attention of a few rows over a contiguous history (``native/attend_rows.c``):
equal to the masked SDPA it replaces for prefill chunks on the CPU, for tiles of rows and blocks of
keys cut anywhere, over key rows that are views into a longer store buffer; and a tiered turn's
attention part in one call, equal to the torch ops it replaces."""
import pytest
import torch

from rocketkv_mt import attention_ops, dispatch
from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.native import attend_rows as native_rows
from rocketkv_mt.native import available
from rocketkv_mt.split_attention import ROWS, Part, attend_part

from test_prefill_attention import reference_dense

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here")


def stored(hkv, length, d, gen, spare=37, fill=0.0):
    """Keys and values as a store holds them: (Hkv, L, d) views into (Hkv, L + spare, d) buffers."""
    kb = torch.full((hkv, length + spare, d), fill)
    vb = torch.full((hkv, length + spare, d), fill)
    kb[:, :length] = torch.randn(hkv, length, d, generator=gen)
    vb[:, :length] = torch.randn(hkv, length, d, generator=gen)
    return kb[:, :length], vb[:, :length]


# (Hkv, G, n, L, d): rows G*n a multiple of the 4-row tile and 1, 2 or 3 past one, keys not a multiple
# of the 64-key block, chunks over long histories, a whole first turn (n = L), one row.
SHAPES = [(3, 3, 8, 1000, 64), (2, 3, 5, 70, 64), (1, 4, 17, 130, 128), (3, 1, 64, 64, 64), (2, 2, 1, 300, 64),
          (1, 3, 33, 65, 128), (2, 4, 3, 7, 64), (1, 1, 5, 90, 128)]


@pytest.mark.parametrize("hkv,g,n,length,d", SHAPES)
def test_native_rows_equal_the_masked_reference(hkv, g, n, length, d):
    gen = torch.Generator().manual_seed(length + n)
    q = torch.randn(hkv * g, n, d, generator=gen)
    keys, values = stored(hkv, length, d, gen)
    assert dispatch.native_takes_rows("auto", q, keys, values)
    torch.testing.assert_close(dispatch.causal_rows(q, keys, values, 0.125),
                               reference_dense(q, keys, values, 0.125), atol=1e-5, rtol=0)


def test_slots_past_the_history_are_never_read():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 8, 64, generator=gen)
    keys, values = stored(2, 200, 64, gen, fill=float("nan"))
    out = dispatch.causal_rows(q, keys, values, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference_dense(q, keys.clone(), values.clone(), 0.125), atol=1e-5, rtol=0)


def test_dense_attention_takes_the_kernel_for_few_rows_only(monkeypatch):
    """With several intra-op threads, more rows than NATIVE_ROWS go to SDPA; with one, to the kernel."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    calls = []
    native = dispatch.causal_rows
    monkeypatch.setattr(dispatch, "causal_rows", lambda *a: calls.append(a[0].shape[1]) or native(*a))
    gen = torch.Generator().manual_seed(2)
    keys, values = stored(2, 300, 64, gen)
    for n in (8, attention_ops.NATIVE_ROWS, attention_ops.NATIVE_ROWS + 1):
        q = torch.randn(4, n, 64, generator=gen)
        torch.testing.assert_close(dense_attention(q, keys, values, 0.125), reference_dense(q, keys, values, 0.125),
                                   atol=1e-5, rtol=0)
    assert calls == [8, attention_ops.NATIVE_ROWS]
    q = torch.randn(4, 8, 64, generator=gen)
    dense_attention(q, keys, values, 0.125, backend="torch")
    assert calls == [8, attention_ops.NATIVE_ROWS]  # the torch backend keeps SDPA
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    q = torch.randn(4, 2 * attention_ops.NATIVE_ROWS, 64, generator=gen)
    torch.testing.assert_close(dense_attention(q, keys, values, 0.125), reference_dense(q, keys, values, 0.125),
                               atol=1e-5, rtol=0)
    assert calls == [8, attention_ops.NATIVE_ROWS, 2 * attention_ops.NATIVE_ROWS]


def test_the_kernel_declines_what_it_cannot_take():
    q, keys = torch.randn(4, 8, 32), torch.randn(2, 50, 32)
    assert not dispatch.native_takes_rows("auto", q, keys, keys)  # head dim 32
    q, keys = torch.randn(4, 8, 64, dtype=torch.float64), torch.randn(2, 50, 64, dtype=torch.float64)
    assert not dispatch.native_takes_rows("auto", q, keys, keys)
    q, keys = torch.randn(4, 8, 64), torch.randn(2, 64, 50).transpose(1, 2)  # key rows not contiguous
    assert not dispatch.native_takes_rows("auto", q, keys, keys)


def test_a_store_zeroes_the_slots_a_partial_page_reads_but_not_its_whole_reservation():
    """A long prefill reserves its buffers at its first chunk; only the slack past the kept tokens is
    zeroed then (the rest as appends reach it), and whatever the allocator left there never shows."""
    store = LayerKV(2, 16, torch.float32, torch.device("cpu"), chunk=64)
    store.append(torch.randn(2, 10, 16), torch.randn(2, 10, 16), torch.arange(10))
    store.reserve(5000)
    keys, values = store.buffers
    assert keys.shape[1] >= 5000 + LayerKV.SLACK
    assert store._clean < 1000  # noqa: SLF001 - what was zeroed up front
    for buf in (*store.buffers, store.position_buffer):  # what fresh memory may hold past that
        buf[:, store._clean :] = float("nan") if buf.is_floating_point() else -(2**62)  # noqa: SLF001
    for i in range(300):
        store.reserve(store.length + 1)
        store.append(torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.tensor([10 + i]))
        end = store.length + LayerKV.SLACK
        assert (store.buffers[0][:, store.length : end] == 0).all()
        assert (store.buffers[1][:, store.length : end] == 0).all()
        assert (store.position_buffer[:, store.length : end] == 0).all()


def test_a_store_keeps_every_appended_token_across_moves():
    store = LayerKV(1, 4, torch.float32, torch.device("cpu"), chunk=16)
    keys = torch.randn(1, 500, 4)
    for start, n in [(0, 3), (3, 1), (4, 40), (44, 1), (45, 200), (245, 255)]:  # appends that outgrow the buffers
        store.append(keys[:, start : start + n], keys[:, start : start + n], torch.arange(start, start + n))
        assert torch.equal(store.positions[0], torch.arange(start + n))
        assert torch.equal(store.keys, keys[:, : start + n])


@pytest.mark.parametrize("hkv,m,t,d", [(3, 69, 699, 64), (2, 5, 64, 64), (1, 18, 130, 128), (3, 1, 7, 64), (2, 7, 0, 64)])
def test_part_products_equal_batched_matmuls(hkv, m, t, d):
    # Rows a multiple of the 4-row tile and past one, keys not a multiple of the 64-key block, none at all;
    # keys and values as views into longer store buffers.
    gen = torch.Generator().manual_seed(m + t)
    q = torch.randn(hkv, m, d, generator=gen)
    keys, values = stored(hkv, t, d, gen, fill=float("nan"))  # slots past the keys are never read
    assert native_rows.takes_rows(q, keys)
    logits = native_rows.part_logits(q, keys, 0.125)
    torch.testing.assert_close(logits, torch.matmul(q, keys.transpose(1, 2)) * 0.125, atol=1e-5, rtol=1e-5)
    probs = torch.softmax(torch.randn(hkv, m, t, generator=gen), -1) if t else torch.zeros(hkv, m, 0)
    torch.testing.assert_close(native_rows.part_values(probs, values), torch.matmul(probs, values), atol=1e-5, rtol=1e-5)
    assert torch.equal(dispatch.part_logits(q, keys, 0.125, backend="torch"), torch.matmul(q, keys.transpose(1, 2)) * 0.125)


def test_part_products_decline_what_they_cannot_take():
    q, keys = torch.randn(2, 4, 32), torch.randn(2, 9, 32)  # head dim 32
    assert not native_rows.takes_rows(q, keys)
    assert not native_rows.takes_rows(q.double(), keys.double())
    with pytest.raises(ValueError):
        native_rows.part_logits(q, keys, 1.0)
    q64, keys64 = torch.randn(2, 4, 64), torch.randn(3, 9, 64)  # a head more than the rows have
    with pytest.raises(ValueError):
        native_rows.part_logits(q64, keys64, 1.0)
    with pytest.raises(ValueError):  # fewer value rows than the probabilities' keys
        native_rows.part_values(torch.rand(2, 4, 9), torch.randn(2, 8, 64))
    assert torch.allclose(dispatch.part_logits(q, keys, 0.5), torch.matmul(q, keys.transpose(1, 2)) * 0.5)


def torch_part(*args, **kwargs) -> Part:
    return attend_part(*args, **kwargs, backend="torch")


# (Hkv, G, n, T, d, w, own_tail, first_row, visible): the window part of a short turn (its own keys
# last, causal), the rows before it (first_row 0, no window), a read-back part (slots without tokens,
# a head that sees none), a window longer than the rows, head dim 128, one row.
PARTS = [(3, 3, 25, 281, 64, 25, 25, 0, False), (3, 3, 7, 300, 64, 0, 32, 0, False),
         (3, 3, 9, 290, 64, 9, 32, 23, False), (3, 3, 25, 384, 64, 25, 0, 0, True),
         (2, 4, 12, 150, 128, 32, 0, 0, True), (1, 3, 1, 70, 64, 1, 1, 0, False), (2, 2, 40, 65, 128, 16, 40, 0, True)]


@pytest.mark.parametrize("hkv,g,n,t,d,w,own_tail,first_row,hidden", PARTS)
def test_a_whole_part_in_one_call_equals_the_torch_part(hkv, g, n, t, d, w, own_tail, first_row, hidden):
    gen = torch.Generator().manual_seed(t + n)
    q = torch.randn(hkv * g, n, d, generator=gen)
    keys, values = stored(hkv, t, d, gen)
    visible = None
    if hidden:
        visible = torch.rand(hkv, t, generator=gen) > 0.3
        visible[0] = False  # a head whose rows see no key: output 0, log-sum-exp -inf
    assert dispatch.takes_part(q, keys, values)
    native = Part(*dispatch.whole_part(q, keys, values, 0.3, w, own_tail, visible, first_row))
    reference = torch_part(q, keys, values, 0.3, w, own_tail=own_tail, visible=visible, first_row=first_row)
    torch.testing.assert_close(native.out, reference.out, atol=1e-5, rtol=0)
    torch.testing.assert_close(native.lse, reference.lse, atol=1e-5, rtol=0)  # -inf where the reference has it
    if w:
        torch.testing.assert_close(native.window_probs, reference.window_probs, atol=1e-6, rtol=0)
        torch.testing.assert_close(native.window_top, reference.window_top, atol=1e-5, rtol=0)
    else:
        assert native.window_probs is None and reference.window_probs is None
    if hidden:
        assert torch.isneginf(native.lse[:g]).all() and not native.out[:g].any()


def test_attend_part_takes_the_one_call_for_a_turn_of_few_rows_only(monkeypatch):
    calls = []
    part = native_rows.part
    monkeypatch.setattr(native_rows, "part", lambda *a: calls.append(a[0].shape[1]) or part(*a))
    gen = torch.Generator().manual_seed(3)
    keys, values = stored(3, 90, 64, gen)
    attend_part(torch.randn(9, 20, 64, generator=gen), keys, values, 0.3, 8, own_tail=20)
    attend_part(torch.randn(9, ROWS + 1, 64, generator=gen), keys, values, 0.3, 8)  # row blocks: the torch ops
    attend_part(torch.randn(9, 20, 64, dtype=torch.float64, generator=gen), keys.double(), values.double(), 0.3, 8)
    assert calls == [20]
