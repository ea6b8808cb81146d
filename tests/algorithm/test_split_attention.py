"""Attention in parts merged by log-sum-exp equals one attention over the union, and its window
scores equal Stage 1's over the same slots (the tiered turn's device part and read-back part)."""
import pytest
import torch

from rocketkv_mt.attention_ops import positional_attention
from rocketkv_mt.split_attention import ROWS, attend_part, join_rows, merge, window_probs


def union_reference(q, parts_k, parts_v, parts_pos, parts_alive, history, scaling):
    keys, values = torch.cat(parts_k, 1), torch.cat(parts_v, 1)
    pos, alive = torch.cat(parts_pos, 1), torch.cat(parts_alive, 1)
    n = q.shape[1]
    out = positional_attention(q, torch.arange(history - n, history), keys, values, pos, alive, scaling)
    hq, hkv, d = q.shape[0], keys.shape[0], q.shape[2]
    g = hq // hkv
    logits = torch.matmul(q.reshape(hkv, g * n, d), keys.transpose(1, 2)) * scaling
    hidden = (pos.unsqueeze(1) > torch.arange(history - n, history).repeat(g).view(1, -1, 1)) | ~alive.unsqueeze(1)
    probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), -1).sum(1)
    return out, probs


@pytest.mark.parametrize("d", [16, 64])  # 64: the native part products where a C compiler builds them
@pytest.mark.parametrize("n,group", [(5, 3), (17, 1), (40, 4)])
def test_two_parts_merge_to_the_attention_over_their_union(n, group, d):
    torch.manual_seed(n)
    hkv, t, m, history = 2, 30 + n, 24, 200
    hq = hkv * group
    q = torch.randn(hq, n, d)
    k, v = torch.randn(hkv, t, d), torch.randn(hkv, t, d)  # device: history slots, then the turn's n tokens
    ck, cv = torch.randn(hkv, m, d), torch.randn(hkv, m, d)  # read back from the cold tiers
    alive = torch.rand(hkv, m) > 0.3
    alive[1] = False  # a head whose read-back part holds nothing
    dpos = torch.cat([torch.randint(0, history - n, (hkv, t - n)), torch.arange(history - n, history).expand(hkv, n)], 1)
    cpos = torch.randint(0, history - n, (hkv, m))
    a = attend_part(q, k, v, 0.3, n, own_tail=n)
    b = attend_part(q, ck, cv, 0.3, n, visible=alive)
    out, lse = merge([a, b], q.dtype)
    probs = torch.cat([window_probs(a, lse), window_probs(b, lse)], 1)
    ref_out, ref_probs = union_reference(q, [k, ck], [v, cv], [dpos, cpos], [torch.ones(hkv, t, dtype=torch.bool), alive], history, 0.3)
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert torch.allclose(probs, ref_probs, atol=1e-5)
    assert torch.all(probs[:, t:][~alive] == 0)


def test_long_turns_pass_in_row_blocks_and_keep_only_the_window_rows():
    torch.manual_seed(1)
    hkv, g, d, n, w = 1, 2, 8, ROWS + 7, 32
    q = torch.randn(hkv * g, n, d)
    k, v = torch.randn(hkv, n + 5, d), torch.randn(hkv, n + 5, d)
    part = attend_part(q, k, v, 0.2, w, own_tail=n)
    assert part.window_probs.shape == (hkv, g, w, n + 5)
    pos = torch.cat([torch.arange(5), torch.arange(100, 100 + n)]).expand(hkv, -1)
    ref = positional_attention(q, torch.arange(100, 100 + n), k, v, pos, None, 0.2)
    out, lse = merge([part], q.dtype)
    assert torch.allclose(out, ref, atol=1e-5)
    qw = q[:, -w:]
    logits = torch.matmul(qw.reshape(hkv, g * w, d), k.transpose(1, 2)) * 0.2
    hidden = pos.unsqueeze(1) > torch.arange(100 + n - w, 100 + n).repeat(g).view(1, -1, 1)
    ref_probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), -1).sum(1)
    assert torch.allclose(window_probs(part, lse), ref_probs, atol=1e-5)


@pytest.mark.parametrize("n,w", [(40, 8), (ROWS + 9, 32), (8, 8)])
def test_window_rows_first_then_the_rest_equal_one_pass(n, w):
    """A tiered turn attends with its window rows first (to rank the cold pages and start reading
    them) and with the other rows while the read runs: the joined part is the one-pass part."""
    torch.manual_seed(n)
    hkv, g, d = 2, 2, 8
    q = torch.randn(hkv * g, n, d)
    k, v = torch.randn(hkv, n + 11, d), torch.randn(hkv, n + 11, d)
    whole = attend_part(q, k, v, 0.25, w, own_tail=n)
    window = attend_part(q[:, n - w :], k, v, 0.25, w, own_tail=n, first_row=n - w)
    assert window.lse.shape == (hkv * g, w)
    if n > w:
        rest = attend_part(q[:, : n - w], k, v, 0.25, 0, own_tail=n)
        assert rest.window_probs is None and rest.window_top is None
        window = join_rows(rest, window)
    assert torch.allclose(window.out, whole.out, atol=1e-6) and torch.allclose(window.lse, whole.lse, atol=1e-5)
    assert torch.allclose(window_probs(window, window.lse), window_probs(whole, whole.lse), atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_softmax_rows_take_each_rows_exponentials_from_its_max_and_sum_them(backend):
    """Hidden logits (-inf) give 0 and no NaN; a row with every logit hidden gets max 0 and sum 0."""
    from rocketkv_mt import dispatch
    from rocketkv_mt.native import softmax_rows as native

    if backend == "native" and not native.supports(torch.zeros(1)):
        pytest.skip("no C compiler: the native kernel is not built here")
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, 77, generator=gen) * 6
    logits[..., ::3] = float("-inf")
    logits[1, 2, 4] = float("-inf")
    want = torch.softmax(logits.double(), dim=-1)
    finite_max = torch.where(torch.isfinite(logits), logits, -1e30).amax(dim=-1, keepdim=True)
    top, total = dispatch.softmax_rows(logits, backend=backend)
    assert top.shape == total.shape == (2, 3, 5, 1) and torch.isfinite(logits).all()
    assert (logits[..., ::3] == 0).all() and top[1, 2, 4, 0] == 0 and total[1, 2, 4, 0] == 0
    seen = total.squeeze(-1) > 0
    assert torch.equal(top[seen], finite_max[seen])  # each row's exponentials are taken from its max
    torch.testing.assert_close((logits / total.clamp_min(1e-30)).double()[seen], want[seen], rtol=1e-5, atol=1e-7)
