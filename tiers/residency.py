"""Where a layer's cold tokens are, as the memory map reads it (``rocketkv_mt.cache.memory_map``).

Bookkeeping only: positions and small codes per KV head, taken from a ``ColdLayer``'s page table and
the host tier's record of which pages it holds and which only Redis does. No page byte is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The tier a cold page is in, as ``HostTier.where_many`` answers it, by code.
IN_HOST, IN_REDIS, NOWHERE = 1, 2, 0
TIER_CODES = {"host": IN_HOST, "redis": IN_REDIS, "none": NOWHERE}


@dataclass(frozen=True)
class ColdResidency:
    """One layer's cold tokens, per KV head: ``positions[h]`` (n,) and ``tiers[h]`` (n,) int8, the tier
    code of each token's page; ``promoted[h]`` / ``demoted[h]``: the positions the turn under way (or
    the last one) brought back to the device / made cold."""

    positions: list[torch.Tensor]
    tiers: list[torch.Tensor]
    promoted: list[torch.Tensor]
    demoted: list[torch.Tensor]
