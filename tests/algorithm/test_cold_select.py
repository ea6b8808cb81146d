"""Choosing cold pages (``rocketkv_mt.cold_select``) and re-selecting over a partly held history
(``rocketkv_mt.reselect``): pure tensor logic, no model."""
import math

import pytest
import torch

from rocketkv_mt.cold_select import candidate_pages, page_bounds
from rocketkv_mt.pool_mass import FLOOR
from rocketkv_mt.reselect import reselect
from rocketkv_mt.stage1 import snapkv_keep_indices, window_scores


def split_history(hkv: int, history: int, w: int, cold_n: int, gen: torch.Generator):
    """Per head, ``cold_n`` cold positions (before the window) and the device positions (the rest,
    window included), both ascending."""
    cold, device = [], []
    for _ in range(hkv):
        perm = torch.randperm(history - w, generator=gen)
        cold.append(perm[:cold_n].sort().values)
        device.append(torch.cat([perm[cold_n:].sort().values, torch.arange(history - w, history)]))
    return torch.stack(cold), torch.stack(device)


def window_lse(q_win, keys, key_pos, history_len, scaling):
    """Each window row's log-sum-exp over the device slots it may see (dead slots: position -1)."""
    hq, w, d = q_win.shape
    hkv = keys.shape[0]
    g = hq // hkv
    logits = torch.matmul(q_win.reshape(hkv, g * w, d).float(), keys.float().transpose(1, 2)) * scaling
    q_pos = torch.arange(history_len - w, history_len).repeat(g)
    hidden = (key_pos.unsqueeze(1) > q_pos.view(1, -1, 1)) | (key_pos.unsqueeze(1) < 0)
    return torch.logsumexp(logits.masked_fill(hidden, float("-inf")), dim=-1)


@pytest.mark.parametrize("group", [1, 4])
def test_page_bounds_bound_every_cold_token_of_the_page(group):
    gen = torch.Generator().manual_seed(group)
    hkv, w, d, history, p, cold_n = 2, 6, 16, 120, 8, 48
    scaling = d ** -0.5
    q = torch.randn(hkv * group, w, d, generator=gen) * 2
    keys = torch.randn(hkv, history, d, generator=gen) * 2  # the whole history, in position order
    cold_pos, dev_pos = split_history(hkv, history, w, cold_n, gen)
    # The device slots: their keys, plus a few dead (-1) slots holding junk that must not count.
    dev_keys = torch.stack([keys[h, dev_pos[h]] for h in range(hkv)])
    dev_keys = torch.cat([dev_keys, torch.full((hkv, 3, d), 50.0)], dim=1)
    dev_pos = torch.cat([dev_pos, torch.full((hkv, 3), -1)], dim=1)
    lse = window_lse(q, dev_keys, dev_pos, history, scaling)
    assert lse.shape == (hkv, group * w) and torch.isfinite(lse).all()

    # Cold keys grouped in pages of p (the last page also has one page of a single repeated key).
    cold_keys = torch.stack([keys[h, cold_pos[h]] for h in range(hkv)]).view(hkv, cold_n // p, p, d)
    cold_keys = torch.cat([cold_keys, cold_keys[:, :1, :1].expand(hkv, 1, p, d)], dim=1)
    kmin, kmax = cold_keys.amin(dim=2), cold_keys.amax(dim=2)
    bounds = page_bounds(q, kmin, kmax, lse, scaling)
    assert bounds.shape == (hkv, cold_keys.shape[1]) and bounds.dtype == torch.float32

    # The exact quantity per cold key: sum over the window queries (and the group) of exp(q.k s - lse).
    qq = q.reshape(hkv, group * w, d).double()
    logits = torch.einsum("hqd,hnpd->hqnp", qq, cold_keys.double()) * scaling
    exact = torch.exp(logits - lse.double()[:, :, None, None]).sum(dim=1)  # (hkv, pages, p)
    tol = 1e-5 * bounds.double() + 1e-30
    assert (exact <= bounds.double().unsqueeze(-1) + tol.unsqueeze(-1)).all()
    # A page of one repeated key: the bound is the key's own quantity (tight).
    assert torch.allclose(bounds[:, -1].double(), exact[:, -1, 0], rtol=1e-4)

    # And it bounds Stage 1's real score of each cold token (softmax over the whole history).
    real = window_scores(q, keys, scaling)  # (hkv, history - w)
    for h in range(hkv):
        per_token = bounds[h, : cold_n // p].repeat_interleave(p)
        assert (real[h, cold_pos[h]] <= per_token * (1 + 1e-5)).all()


def brute_top(scores: torch.Tensor, live: torch.Tensor, k: int) -> list[torch.Tensor]:
    out = []
    for h in range(scores.shape[0]):
        idx = torch.nonzero(live[h]).flatten().tolist()
        best = sorted(idx, key=lambda i: -float(scores[h, i]))[:k]
        out.append(torch.tensor(sorted(best), dtype=torch.long))
    return out


@pytest.mark.parametrize("per_head", [0, 1, 3, 7, 12, 40])
def test_candidate_pages_are_the_top_live_pages(per_head):
    gen = torch.Generator().manual_seed(per_head)
    hkv, n = 4, 12
    scores = torch.rand(hkv, n, generator=gen) * 10
    live = torch.rand(hkv, n, generator=gen) < 0.6
    live[1] = False  # a head with nothing cold
    live[2] = False
    live[2, [3, 9]] = True  # a head with fewer live pages than asked for
    live[3] = True
    scores[0, ~live[0]] += 100  # dead pages scoring highest must still never be chosen
    table = candidate_pages(scores, live, per_head)
    want = brute_top(scores, live, per_head)
    assert table.shape == (hkv, max(len(x) for x in want))  # padded to the head that got most
    got = [row[row >= 0] for row in table]
    for h in range(hkv):
        assert (table[h, len(got[h]):] == -1).all()  # a head's own pages first, then padding
        assert got[h].dtype == torch.long and torch.equal(got[h], want[h]), (h, got[h], want[h])
        assert len(got[h]) == min(per_head, int(live[h].sum()))
        assert bool(live[h][got[h]].all())
        assert torch.equal(got[h], got[h].sort().values)


def test_candidate_pages_with_tied_scores_still_pick_a_valid_top():
    """Scores that underflow to 0 tie: any choice among them is right, as long as it is a top-k."""
    hkv, n, k = 2, 10, 4
    scores = torch.zeros(hkv, n)
    scores[:, 7] = 1.0
    live = torch.ones(hkv, n, dtype=torch.bool)
    live[:, 0] = False
    got = candidate_pages(scores, live, k)
    assert (got >= 0).all()
    for h in range(hkv):
        assert len(got[h]) == k and 7 in got[h].tolist() and bool(live[h][got[h]].all())


def scatter_history(keys: torch.Tensor, held: list[torch.Tensor], extra: int, gen: torch.Generator):
    """Slots (Hkv, T) holding, per head, the positions in ``held`` in a random order, with dead slots
    (junk keys, position 0 or -1) in between."""
    hkv, _, d = keys.shape
    t = max(len(x) for x in held) + extra
    out_k = torch.randn(hkv, t, d, generator=gen, dtype=keys.dtype) * 5
    pos = torch.zeros(hkv, t, dtype=torch.long)
    pos[:, ::2] = -1
    alive = torch.zeros(hkv, t, dtype=torch.bool)
    for h, positions in enumerate(held):
        slots = torch.randperm(t, generator=gen)[: len(positions)]
        out_k[h, slots] = keys[h, positions]
        pos[h, slots] = positions
        alive[h, slots] = True
    return out_k, pos, alive


@pytest.mark.parametrize("group", [1, 2])
def test_reselect_keeps_only_held_positions(group):
    gen = torch.Generator().manual_seed(10 + group)
    hkv, w, d, history, budget, kernel = 3, 8, 16, 160, 48, 5
    scaling = d ** -0.5
    q = torch.randn(hkv * group, w, d, generator=gen, dtype=torch.float64)
    keys = torch.randn(hkv, history, d, generator=gen, dtype=torch.float64)
    window = torch.arange(history - w, history)
    held = []
    for n_prefix in [100, 70, 30]:  # the last head holds fewer than the budget asks
        prefix = torch.randperm(history - w, generator=gen)[:n_prefix].sort().values
        held.append(torch.cat([prefix, window]))
    slot_keys, pos, alive = scatter_history(keys, held, 30, gen)
    slots, positions, scores = reselect(q, slot_keys, pos, alive, history, budget, kernel, scaling)
    keep = min(budget - w, 30)
    assert positions.shape == slots.shape == scores.shape == (hkv, keep + w)
    for h in range(hkv):
        assert set(positions[h].tolist()) <= set(held[h].tolist())
        assert torch.equal(positions[h], positions[h].sort().values)
        assert torch.equal(positions[h, -w:], window)
    assert torch.equal(torch.gather(pos, 1, slots), positions)
    assert torch.gather(alive, 1, slots).all()


@pytest.mark.parametrize("group", [1, 3])
def test_reselect_with_every_position_held_equals_stage1(group):
    gen = torch.Generator().manual_seed(20 + group)
    hkv, w, d, history, budget, kernel = 2, 8, 16, 130, 40, 7
    scaling = d ** -0.5
    q = torch.randn(hkv * group, w, d, generator=gen, dtype=torch.float64)
    keys = torch.randn(hkv, history, d, generator=gen, dtype=torch.float64)
    want = snapkv_keep_indices(q, keys, budget, kernel, scaling)
    everything = [torch.arange(history)] * hkv
    slot_keys, pos, alive = scatter_history(keys, everything, 25, gen)
    slots, positions, _ = reselect(q, slot_keys, pos, alive, history, budget, kernel, scaling)
    assert torch.equal(positions, want)
    assert torch.equal(torch.gather(pos, 1, slots), want) and torch.gather(alive, 1, slots).all()
    # The same with the history in position order and no alive mask (how the non-tiered cache calls it).
    ordered = torch.arange(history).expand(hkv, -1)
    slots, positions, _ = reselect(q, keys, ordered, None, history, budget, kernel, scaling)
    assert torch.equal(positions, want) and torch.equal(slots, want)


def test_a_pending_selection_keeps_exactly_the_tokens_it_promotes():
    from rocketkv_mt.cache.prefill.tiered.choice import promoted_only

    g = torch.Generator().manual_seed(3)
    hkv, t, m, d = 3, 10, 12, 4
    device_keys = torch.randn(hkv, t, d, generator=g)
    cand = (torch.randn(hkv, m, d, generator=g), torch.randn(hkv, m, d, generator=g),
            torch.randint(0, 100, (hkv, m), generator=g), torch.ones(hkv, m, dtype=torch.bool),
            torch.arange(m).repeat(hkv, 1) + 1000)
    # Per head a different number of promotions (2, 0, 5), in ascending slot order like Stage 1's choice.
    slots = torch.stack([
        torch.tensor([0, 2, 3, 5, 7, 9, t + 1, t + 6]),
        torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
        torch.tensor([1, 4, 9, t + 0, t + 2, t + 3, t + 8, t + 11]),
    ])
    new_slots, kept = promoted_only(slots, t, cand)
    assert kept[0].shape == (hkv, 5, d)  # the largest count of promotions
    assert kept[3].sum(dim=1).tolist() == [2, 0, 5]  # padding is dead
    for h in range(hkv):
        before = torch.cat([device_keys[h], cand[0][h]])[slots[h]]
        after = torch.cat([device_keys[h], kept[0][h]])[new_slots[h]]
        assert torch.equal(before, after)
        cold = slots[h] >= t
        assert torch.equal(kept[4][h][new_slots[h][cold] - t], cand[4][h][slots[h][cold] - t])
        assert (kept[4][h][~kept[3][h]] == -1).all()


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("group", [1, 3])
def test_page_picks_with_exact_keys_count_the_tokens_exhaustive_stage1_keeps(group, backend):
    """With every cold key known exactly (a perfect sketch), a page's rank is the number of its tokens
    that Stage 1 over the device and every cold token keeps: exhaustive's choice, before any page read;
    pages with none rank by the window mass of their tokens, below every page with one."""
    check_page_picks(group, seed=40 + group, spread=2.0, dead_head=None, backend=backend)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_page_picks_hold_with_far_logits_and_a_head_whose_pool_is_empty(backend):
    # Keys 8x larger put most of a row's shares far below exp(-43) (floored there, not underflowing),
    # and a head whose pool pages are all padding (every slot dead) must rank none of them.
    check_page_picks(3, seed=47, spread=8.0, dead_head=1, backend=backend)


def test_page_picks_in_bfloat16_fetch_the_pages_float32_does():
    """A sketch scored in bfloat16 (``sketch_dtype`` on a CPU that multiplies it in hardware) ranks
    the pages as float32 does: the same best pages, Stage 1 keeping nearly the same tokens of each."""
    from rocketkv_mt.cold_select import page_picks
    from rocketkv_mt.split_attention import attend_part

    gen = torch.Generator().manual_seed(11)
    hkv, group, w, d, history, budget, kernel, p, cold_n = 2, 4, 16, 64, 1200, 200, 7, 16, 960
    q = torch.randn(hkv * group, w, d, generator=gen)
    keys = torch.randn(hkv, history, d, generator=gen) * 1.5
    cold_pos, dev_pos = split_history(hkv, history, w, cold_n, gen)
    gather = lambda t, pos: torch.stack([t[h, pos[h]] for h in range(hkv)])  # noqa: E731
    alive = torch.rand(hkv, cold_n, generator=gen) < 0.9
    window = attend_part(q, gather(keys, dev_pos), torch.randn(hkv, dev_pos.shape[1], d, generator=gen), d ** -0.5,
                         w, own_tail=w)
    args = (cold_pos, alive, dev_pos, history, budget, kernel, d ** -0.5, p)
    exact = page_picks(q, window, gather(keys, cold_pos), *args).ranks
    half = page_picks(q, window, gather(keys, cold_pos).bfloat16(), *args).ranks
    assert exact.floor().sum() > budget // 2  # most of the choice is cold: the ranking matters
    best = lambda r: {int(i) for i in r.topk(8).indices}  # noqa: E731
    for h in range(hkv):
        assert len(best(exact[h]) & best(half[h])) >= 7
    assert (exact.floor() - half.floor()).abs().sum() <= 0.05 * exact.floor().sum()


def check_page_picks(group: int, seed: int, spread: float, dead_head: int | None, backend: str) -> None:
    from rocketkv_mt.cold_select import page_picks
    from rocketkv_mt.split_attention import attend_part

    gen = torch.Generator().manual_seed(seed)
    hkv, w, d, history, budget, kernel, p, cold_n = 2, 6, 16, 150, 40, 5, 8, 64
    scaling = d ** -0.5
    q = torch.randn(hkv * group, w, d, generator=gen) * 2
    keys = torch.randn(hkv, history, d, generator=gen) * spread
    values = torch.randn(hkv, history, d, generator=gen)
    cold_pos, dev_pos = split_history(hkv, history, w, cold_n, gen)  # device slots end with the window
    gather = lambda t, pos: torch.stack([t[h, pos[h]] for h in range(hkv)])  # noqa: E731
    dev_keys, cold_keys = gather(keys, dev_pos), gather(keys, cold_pos)
    cold_alive = torch.rand(hkv, cold_n, generator=gen) < 0.8  # promoted tokens keep their page slot
    if dead_head is not None:
        cold_alive[dead_head] = False
    cold_pos_seen = torch.where(cold_alive, cold_pos, -1)
    window = attend_part(q, dev_keys, gather(values, dev_pos), scaling, w, own_tail=w)

    scores = page_picks(q, window, cold_keys, cold_pos, cold_alive, dev_pos, history, budget, kernel, scaling, p,
                        backend=backend)
    ranks = scores.ranks
    assert ranks.shape == (hkv, cold_n // p) and torch.isfinite(ranks).all()


    # Exhaustive: Stage 1 over the device slots and the alive cold ones, all in one set.
    all_keys = torch.cat([dev_keys, cold_keys], dim=1)
    all_pos = torch.cat([dev_pos, cold_pos_seen], dim=1)
    alive = torch.cat([torch.ones_like(dev_pos, dtype=torch.bool), cold_alive], dim=1)
    slots, _, _ = reselect(q, all_keys, all_pos, alive, history, budget, kernel, scaling)
    t = dev_pos.shape[1]
    for h in range(hkv):
        cold_slots = slots[h][slots[h] >= t] - t
        want = torch.bincount(cold_slots // p, minlength=cold_n // p)
        assert want.sum() > 0 or h == dead_head  # the case exercises promotions
        assert torch.equal(ranks[h].floor().long(), want), (h, ranks[h], want)
        frac = ranks[h] - ranks[h].floor()
        assert (frac >= 0).all() and (frac <= 0.5 + 1e-6).all()
        # A page's window mass: each row's softmax over the device (the window's own tokens causal) and the
        # alive cold keys, summed over the rows and the page's alive tokens.
        qq = q.reshape(hkv, group * w, d)[h]
        lse = torch.logaddexp(window.lse.reshape(hkv, -1)[h],
                              torch.logsumexp(qq @ cold_keys[h][cold_alive[h]].T * scaling, dim=1)).unsqueeze(1)
        mass = torch.where(cold_alive[h], torch.exp(qq @ cold_keys[h].T * scaling - lse).sum(0), 0.0)
        mass = mass.view(-1, p).sum(1)
        torch.testing.assert_close(scores.mass[h], mass, rtol=1e-4, atol=logits_floor(group * w * p))
        # Among pages Stage 1 keeps nothing of, the one whose tokens carry most window mass ranks first.
        none = want == 0
        if int(none.sum()) > 1:
            assert int(torch.argmax(torch.where(none, ranks[h], -1.0))) == int(torch.argmax(torch.where(none, mass, -1.0)))


def logits_floor(slots: int) -> float:
    """What shares floored at exp(FLOOR) can add to a page's mass over ``slots`` row-slot pairs."""
    return slots * math.exp(FLOOR) + 1e-12



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_picks_over_logits_made_ahead_are_those_it_makes_itself(dtype):
    """The page reader may make the window rows' logits over a sketch beside the device attention
    (``pool_logits``): page picks and mass from them are bit for bit those page_picks makes."""
    from rocketkv_mt.cold_select import page_picks, pool_logits
    from rocketkv_mt.split_attention import attend_part

    gen = torch.Generator().manual_seed(12)
    hkv, group, w, d, history, budget, kernel, p, cold_n = 2, 3, 20, 64, 900, 160, 7, 16, 640
    q = torch.randn(hkv * group, w, d, generator=gen)
    keys = torch.randn(hkv, history, d, generator=gen)
    cold_pos, dev_pos = split_history(hkv, history, w, cold_n, gen)
    gather = lambda t, pos: torch.stack([t[h, pos[h]] for h in range(hkv)])  # noqa: E731
    alive = torch.rand(hkv, cold_n, generator=gen) < 0.9
    window = attend_part(q, gather(keys, dev_pos), torch.randn(hkv, dev_pos.shape[1], d, generator=gen), d ** -0.5,
                         w, own_tail=w)
    sketch = gather(keys, cold_pos).to(dtype)
    args = (cold_pos, alive, dev_pos, history, budget, kernel, d ** -0.5, p)
    logits = pool_logits(q, sketch, d ** -0.5)
    assert logits is not None and logits.shape[:2] == (hkv, 64)  # 60 rows padded to a multiple of 16
    inline, ahead = page_picks(q, window, sketch, *args), page_picks(q, window, sketch, *args, logits=logits)
    assert torch.equal(inline.ranks, ahead.ranks) and torch.equal(inline.mass, ahead.mass)
    # More rows than one product takes (2d): none made ahead, page_picks makes them chunk by chunk.
    assert pool_logits(torch.randn(hkv * 5, 32, d, generator=gen), sketch, d ** -0.5) is None
