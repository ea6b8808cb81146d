"""What every tier reports, what one turn moves between tiers, and the unit that moves: a page.

A page is ``page_tokens`` cold tokens of one KV head of one layer, stored as named tensors (the
codec decides which: raw keys/values, or int8 with scales). Pages never change once written, so a
copy in Redis stays valid for as long as the page exists.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

# Named tensors of n pages, each with a leading page axis: e.g. {"keys": (n, P, d), "values": (n, P, d)}.
PageBatch = dict[str, torch.Tensor]


def batch_nbytes(batch: PageBatch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


@dataclass
class TierStats:
    """Counters of one tier. promotions: entries moved up (colder -> this tier); demotions: moved in from a
    warmer tier; spills: pushed to a colder one; hits/misses: reads served or not. bytes_read: payload
    read out (all sessions; the host tier's include pages just brought back from Redis for the read);
    bytes_written: payload written in from a warmer tier (demotions, or the host's spills and persists)."""

    bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    spills: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Traffic:
    """Bytes one session's cache moved between tiers in a turn (the cache resets it at a turn's start).
    cold_bytes_read: page bytes handed to the device from the cold tiers (host hits and Redis reads);
    redis_bytes_read: the part of it from Redis; digest_bytes_read: page digests scored; bytes_demoted:
    page bytes written from the device into the host tier; redis_bytes_written: bytes this session wrote
    to Redis at persistence (its pages, primary set and index)."""

    cold_bytes_read: int = 0
    redis_bytes_read: int = 0
    digest_bytes_read: int = 0
    bytes_demoted: int = 0
    redis_bytes_written: int = 0

    def add(self, other: "Traffic") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
