"""Grouping a demotion's tokens into pages by their keys (``tiers.cold.page_grouping``), and a cold layer
that pages that way: pure tensors, no model."""
import torch

from tiers.base import Traffic
from tiers.codec import RawCodec
from tiers.cold.layer import ColdLayer
from tiers.host.tier import HostTier
from tiers.cold.page_grouping import group_by_keys

P, D = 16, 8


def clustered(sizes: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys around far-apart centres, shuffled: (keys (n, d), each key's cluster (n,))."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(len(sizes), D, generator=gen) * 20
    label = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    keys = centres[label] + 0.05 * torch.randn(len(label), D, generator=gen)
    shuffle = torch.randperm(len(label), generator=gen)
    return keys[shuffle], label[shuffle]


def test_clusters_of_whole_pages_fill_pages_of_one_cluster_each():
    keys, label = clustered([2 * P, P, 3 * P, P])
    order = group_by_keys(keys, P)
    assert torch.equal(order.sort().values, torch.arange(len(keys)))  # a permutation
    pages = label[order].view(-1, P)
    assert (pages == pages[:, :1]).all()  # no page mixes two clusters
    # Paging by position mixes them: the test's keys would not pass it.
    assert not (label.view(-1, P) == label.view(-1, P)[:, :1]).all()


def test_any_number_of_tokens_gets_a_permutation():
    for n in (1, P - 1, P, P + 1, 5 * P + 3, 37 * P + 11):
        keys = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        order = group_by_keys(keys, P)
        assert torch.equal(order.sort().values, torch.arange(n))


def test_grouped_pages_have_tighter_bounds_than_pages_by_position():
    keys, _ = clustered([24, 40, 17, 50, 29], seed=3)  # sizes that are not whole pages
    whole = (len(keys) // P) * P

    def width(k):
        pages = k[:whole].view(-1, P, D)
        return float((pages.amax(dim=1) - pages.amin(dim=1)).mean())

    assert width(keys[group_by_keys(keys, P)]) < 0.5 * width(keys)


def test_a_layer_paged_by_keys_gives_back_each_position_its_own_key_and_value():
    hkv, store = 2, 70
    keys, _ = clustered([30, 25, 15], seed=5)
    keys = torch.stack([keys, keys.flip(0)])
    values = torch.randn(hkv, store, D, generator=torch.Generator().manual_seed(6))
    positions = torch.stack([torch.arange(store), torch.arange(store) * 2])
    mask = torch.ones(hkv, store, dtype=torch.bool)
    mask[1, :9] = False
    host = HostTier(1 << 20, pin=False)
    layer = ColdLayer("s", 0, host, P, RawCodec(), hkv, D, torch.float32, by_keys=True)
    layer.demote(keys, values, positions, mask)
    pages = layer.live_pages()
    assert (pages >= 0).sum(dim=1).tolist() == [-(-store // P), -(-(store - 9) // P)]  # as many pages as by position
    k, v, pos, alive, _ = layer.fetch(pages, torch.device("cpu"), Traffic())
    for h in range(hkv):
        where = {int(p): i for i, p in enumerate(positions[h].tolist())}
        got = pos[h][alive[h]].tolist()
        assert sorted(got) == positions[h][mask[h]].tolist()
        for j in torch.nonzero(alive[h]).flatten().tolist():
            i = where[int(pos[h, j])]
            assert torch.equal(k[h, j], keys[h, i]) and torch.equal(v[h, j], values[h, i])
    # The digests bound every key of their page.
    kmin, kmax, live, _ = layer.digests(torch.device("cpu"))
    for h in range(hkv):
        for page in pages[h][pages[h] >= 0].tolist():
            rows = slice(page * P, (page + 1) * P)
            real = alive[h, rows]
            assert (k[h, rows][real] >= kmin[h, page].float()).all() and (k[h, rows][real] <= kmax[h, page].float()).all()


def test_parts_are_grouped_on_their_own_and_stay_in_place():
    a, la = clustered([P, 2 * P, P], seed=7)
    b, lb = clustered([3 * P, P + 5], seed=8)
    keys = torch.cat([a, torch.zeros(0, D), b])
    order = group_by_keys(keys, P, [len(a), 0, len(b)])
    assert torch.equal(order[: len(a)].sort().values, torch.arange(len(a)))  # the first part's tokens first
    assert torch.equal(order[len(a):].sort().values, torch.arange(len(a), len(keys)))
    pages = la[order[: len(a)]].view(-1, P)
    assert (pages == pages[:, :1]).all()
    alone = group_by_keys(b, P)
    assert torch.equal(order[len(a):] - len(a), alone)  # the same grouping as the part alone
