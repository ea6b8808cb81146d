"""The stand-in for the pages a tiered turn scores but does not read (``rocketkv_mt.standin``): the
pages it picks are the unread ones with the most window mass; their sketched slots follow the pages
read in what the turn attends over, weigh in the softmax and so in Stage 1's scores, and are never
among the slots Stage 1 may choose."""
import torch

from rocketkv_mt.split_attention import attend_part, merge, window_probs
from rocketkv_mt.standin import StandIn, beside, standin_pages


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


def test_stage1_scores_of_the_pages_read_are_their_share_of_a_softmax_that_holds_the_stand_in():
    gen = torch.Generator().manual_seed(61)
    hkv, group, w, d, t, m, s = 2, 3, 5, 16, 20, 8, 12
    scaling = d ** -0.5
    q = torch.randn(hkv * group, w, d, generator=gen)
    dev_k, dev_v = torch.randn(hkv, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    cand = (torch.randn(hkv, m, d, generator=gen), torch.randn(hkv, m, d, generator=gen),
            torch.arange(m).repeat(hkv, 1), torch.rand(hkv, m, generator=gen) < 0.8, torch.arange(m).repeat(hkv, 1))
    standin = StandIn(torch.randn(hkv, s, d, generator=gen).bfloat16(), torch.randn(hkv, s, d, generator=gen),
                      torch.rand(hkv, s, generator=gen) < 0.7)
    keys, values, visible = beside(cand, standin)
    assert keys.dtype == cand[0].dtype and keys.shape == (hkv, m + s, d)
    assert torch.equal(keys[:, :m], cand[0]) and torch.equal(values[:, m:], standin.values)
    assert torch.equal(visible, torch.cat([cand[3], standin.alive], dim=1))
    assert beside(cand, None) == (cand[0], cand[1], cand[3])

    device = attend_part(q, dev_k, dev_v, scaling, w)
    read = attend_part(q, keys, values, scaling, w, visible=visible)
    out, lse = merge([device, read], torch.float32)
    probs = torch.cat([window_probs(device, lse), window_probs(read, lse)], dim=1)[:, : t + m]
    # The same from one softmax over everything, stand-in slots included, then kept to device and read slots.
    everything = torch.cat([dev_k, keys.float()], dim=1)
    seen = torch.cat([torch.ones(hkv, t, dtype=torch.bool), visible], dim=1)
    logits = (q.reshape(hkv, group * w, d) @ everything.transpose(1, 2) * scaling).masked_fill(~seen.unsqueeze(1), float("-inf"))
    want = torch.softmax(logits, dim=-1).sum(dim=1)[:, : t + m]
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-6)
    assert (want[:, t:].sum() < torch.softmax(logits[..., : t + m], dim=-1).sum(dim=1)[:, t:].sum())  # the stand-in took its share
    whole = attend_part(q, everything, torch.cat([dev_v, values], dim=1), scaling, 0, visible=seen)
    torch.testing.assert_close(out, whole.out, rtol=1e-5, atol=1e-5)
