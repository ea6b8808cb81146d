"""What every tier reports, and the chunk of cold KV that moves between tiers."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class TierStats:
    """Counters of one tier. promotions: entries moved up (colder -> this tier); demotions: moved in from
    a warmer tier; spills: entries this tier pushed to a colder one; hits/misses: reads served or not."""

    bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    spills: int = 0
    errors: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """Up to C cold tokens of one layer of one session, for every KV head.

    keys/values: (Hkv, C, d); positions: (Hkv, C) int64. Which slots are still cold (not promoted)
    is bookkeeping kept outside the chunk, so a chunk's bytes never change once written.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))

    def to(self, device: torch.device, non_blocking: bool = False) -> "Chunk":
        return Chunk(*(t.to(device, non_blocking=non_blocking) for t in (self.keys, self.values, self.positions)))
