"""The tables a cold layer keeps for all its KV heads at once, and what its reads, demotions and memory
map hand back. Shapes: Hkv KV heads, P tokens per page, d head dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Digests are read every turn, so they are kept small: bfloat16, each bound rounded away from the keys
# (kmin down, kmax up), which keeps it a bound of every key of its page.
DIGEST_DTYPE = torch.bfloat16


def outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x in ``DIGEST_DTYPE``, rounded up (``up``) or down so that it still bounds x."""
    r = x.to(DIGEST_DTYPE)
    past = r.float() < x.float() if up else r.float() > x.float()
    return torch.where(past, torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf"))), r)


class Table:
    """Rows of every KV head in one tensor (Hkv, capacity, *row), grown along its second axis (pages,
    or positions); rows past what a head holds are ``fill``."""

    def __init__(self, heads: int, row: tuple[int, ...], dtype: torch.dtype, fill=0):
        self.fill = fill
        self.buf = torch.full((heads, 16, *row), fill, dtype=dtype)

    def ensure(self, pages: int) -> None:
        have = self.buf.shape[1]
        if pages > have:
            grown = torch.full((self.buf.shape[0], max(pages, 2 * have), *self.buf.shape[2:]), self.fill,
                               dtype=self.buf.dtype)
            grown[:, :have] = self.buf
            self.buf = grown

    def take(self, pages: torch.Tensor) -> torch.Tensor:
        """Each head's rows at its pages (Hkv, n) (every entry a row, >= 0): (Hkv, n, *row). One
        ``index_select`` over the heads' rows laid end to end: a broadcast (head, page) index costs
        5-20x more on a CPU (0.6 ms against 32 us for a 260-page pool's codes)."""
        heads, capacity = self.buf.shape[:2]
        flat = (torch.arange(heads).unsqueeze(1) * capacity + pages).flatten()
        return self.buf.flatten(0, 1).index_select(0, flat).view(heads, pages.shape[1], *self.buf.shape[2:])


@dataclass
class Sketched:
    """A pool of cold pages (Hkv, n) as their sketches give them: estimated keys (Hkv, n * P, d), their
    positions and alive flags (Hkv, n * P; a -1 page's slots are dead), and the bytes read for them."""

    keys: torch.Tensor
    positions: torch.Tensor
    alive: torch.Tensor
    nbytes: int


@dataclass
class Demotion:
    """A demotion written but not yet in the page table (``ColdLayer.stage_demotion``): the positions it
    makes cold (Hkv, L; -1: not), the flat slots of those cold again in place (Hkv, L; -1: none), and
    its new pages: their ids, the bytes written, and their table rows (None: no new page)."""

    demoted: torch.Tensor
    again: torch.Tensor
    ids: list[str] = field(default_factory=list)
    written: int = 0
    pages: tuple | None = None


def padded_indices(mask: torch.Tensor) -> torch.Tensor:
    """Per row of mask (H, N), the indices where it is set, ascending, then -1: (H, most set in a row)."""
    n = mask.shape[1]
    key = torch.where(mask, torch.arange(n, device=mask.device), n).sort(dim=1).values
    m = int(mask.sum(dim=1).max()) if mask.numel() else 0
    key = key[:, :m]
    return torch.where(key == n, -1, key)


# The tier a cold page is in, as ``HostTier.where_many`` answers it, by code.
IN_HOST, IN_REDIS, NOWHERE = 1, 2, 0
TIER_CODES = {"host": IN_HOST, "redis": IN_REDIS, "none": NOWHERE}


@dataclass(frozen=True)
class ColdResidency:
    """One layer's cold tokens per KV head: ``positions[h]`` (n,), ``tiers[h]`` (n,) int8 (their pages' tier
    codes); ``promoted[h]`` / ``demoted[h]``: positions the turn under way (or the last) promoted / made cold."""

    positions: list[torch.Tensor]
    tiers: list[torch.Tensor]
    promoted: list[torch.Tensor]
    demoted: list[torch.Tensor]
