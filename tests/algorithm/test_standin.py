"""The stand-in for the pages a tiered turn scores but does not read (``rocketkv_mt.standin``): the
pages it picks are the unread ones with the most window mass, and merged with the device part, the
window rows attend exactly as over the device's keys plus those pages' sketched keys and values; the
rows before the window see nothing of it."""
import pytest
import torch

from rocketkv_mt.split_attention import Part, attend_part, merge
from rocketkv_mt.standin import standin_pages, standin_part


def test_the_stand_in_pages_are_the_unread_ones_with_the_most_window_mass():
    mass = torch.tensor([[0.5, 3.0, 0.2, 2.0, 0.0, 1.0],
                         [0.1, 0.0, 0.0, 0.0, 0.0, 0.0],
                         [4.0, 3.0, 2.0, 1.0, 0.5, 0.2]])
    unread = torch.tensor([[True, False, True, True, True, True],
                           [True, True, False, True, True, True],
                           [False, False, False, False, False, False]])
    picked = standin_pages(mass, unread, 3)
    # Ascending, padded with -1; a page of no mass (padding, nothing alive) never stands in.
    assert picked.tolist() == [[0, 3, 5], [0, -1, -1], [-1, -1, -1]]
    assert standin_pages(mass, unread, 0).shape == (3, 0)


@pytest.mark.parametrize("group", [1, 3])
def test_the_stand_in_merges_as_attention_over_its_sketched_keys_and_values(group):
    gen = torch.Generator().manual_seed(60 + group)
    hkv, n, w, d, t, m = 2, 9, 5, 16, 20, 12
    scaling = d ** -0.5
    hq = hkv * group
    q = torch.randn(hq, n, d, generator=gen)
    dev_k, dev_v = torch.randn(hkv, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    keys, values = torch.randn(hkv, m, d, generator=gen), torch.randn(hkv, m, d, generator=gen)
    alive = torch.rand(hkv, m, generator=gen) < 0.7
    q_win = q[:, n - w :]
    window = attend_part(q_win, dev_k, dev_v, scaling, w)
    part = standin_part(q_win, keys.bfloat16(), values, alive, scaling, n)

    assert part.out.shape == (hq, n, d) and part.lse.shape == (hq, n)
    assert (part.lse[:, : n - w] == float("-inf")).all() and (part.out[:, : n - w] == 0).all()
    out, lse = merge([window, Part(part.out[:, n - w :], part.lse[:, n - w :], None, None)], torch.float32)
    visible = torch.cat([torch.ones(hkv, t, dtype=torch.bool), alive], dim=1)
    want = attend_part(q_win, torch.cat([dev_k, keys.bfloat16().float()], dim=1), torch.cat([dev_v, values], dim=1),
                       scaling, 0, visible=visible)
    torch.testing.assert_close(out, want.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want.lse, rtol=1e-5, atol=1e-5)
    # A turn no longer than the window: every row is a window row.
    whole = standin_part(q_win, keys, values, alive, scaling, w)
    assert whole.out.shape == (hq, w, d) and torch.isfinite(whole.lse).all()
