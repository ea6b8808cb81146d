"""Which demoted tokens share a cold page: tokens whose keys lie close together.

A page's digest bounds every key it holds, channel by channel; the bound is tight only when those keys
are alike. Neighbours in the text often are not, so a page of consecutive positions has loose bounds and
a query's best tokens are spread over many pages. Grouping a demotion's tokens by their keys gives pages
whose bounds rank them well and whose tokens a query tends to want together.

The grouping is a balanced k-d split in the keys' principal axes: the keys are projected on their
``RANK`` main directions (one eigendecomposition of a d x d covariance per KV head), then each group is
cut in two at the median along the axis on which it spreads most, again and again, until it fits a page.
A group keeps ceil(pages / 2) whole pages on one side, so every group but the last of a head holds whole
pages, and there are as many pages as paging by position gives. Shapes: n tokens (several KV heads' runs
one after another), d head dim, P tokens per page.
"""
from __future__ import annotations

import torch

RANK = 8  # principal axes the splits choose among: the few along which keys spread most


def group_by_keys(keys: torch.Tensor, page_tokens: int, parts: list[int] | None = None) -> torch.Tensor:
    """An order of the n tokens (a permutation, (n,) int64) whose consecutive runs of ``page_tokens``
    are groups of similar keys. keys (n, d). ``parts``: the sizes of consecutive parts (one per KV
    head) grouped on their own, each part's tokens staying in its place; default one part."""
    n, device = keys.shape[0], keys.device
    order = torch.arange(n, device=device)
    sizes = torch.tensor(parts if parts is not None else [n], dtype=torch.long, device=device)
    if not bool((sizes > page_tokens).any()):
        return order
    y = torch.cat([_principal(part) for part in keys.float().split(sizes.tolist())])
    rank = y.shape[1]
    # Groups are consecutive runs of ``order``, given by their sizes. Every run is split until it fits a page.
    while bool((sizes > page_tokens).any()):
        groups = sizes.numel()
        group = torch.repeat_interleave(torch.arange(groups, device=device), sizes)
        ys = y[order]
        count = sizes.unsqueeze(1).clamp_min(1).float()
        mean = torch.zeros(groups, rank, device=device).index_add_(0, group, ys) / count
        spread = torch.zeros(groups, rank, device=device).index_add_(0, group, ys * ys) / count - mean * mean
        proj = ys.gather(1, spread.argmax(dim=1)[group].unsqueeze(1)).squeeze(1)
        # Within each run, by projection: sort by projection, then (stably) by run.
        by_proj = torch.argsort(proj)
        order = order[by_proj[torch.argsort(group[by_proj], stable=True)]]
        pages = torch.div(sizes + page_tokens - 1, page_tokens, rounding_mode="floor")
        left = torch.minimum(sizes, torch.div(pages + 1, 2, rounding_mode="floor") * page_tokens)
        split = sizes > page_tokens
        keep = torch.stack([torch.ones_like(split), split], dim=1)
        sizes = torch.stack([left, sizes - left], dim=1)[keep]
    return order


def _principal(x: torch.Tensor) -> torch.Tensor:
    """x (m, d) centred and projected on its ``RANK`` main directions: (m, min(RANK, d))."""
    if x.shape[0] == 0:
        return x.new_zeros(0, min(RANK, x.shape[1]))
    centred = x - x.mean(dim=0)
    _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues: the main axes last
    return centred @ vectors[:, -RANK:]
