"""The cold pages a tiered turn scores but does not read, stood in for in its attention.

A ``digest`` turn with a key sketch scores every token of a pool of cold pages (``cold_select``)
and reads back only the pages Stage 1's choice needs. An ``exhaustive`` turn attends over every
cold token; a digest turn's tokens attend over what it read, so where an unread page carries much
of a window row's softmax mass, the row misses both that mass and that page's values. Measured, a
turn needs those values token by token: a page's mean value in their place blurs the one token a
question turns to. So each page also keeps a value sketch (``tiers.cold.layer``), and the unread
pool pages carrying the most window mass (``PoolScores.mass``) stand in: the turn attends over their
sketched keys and values beside the pages it read (a few bits a channel of each, not the page),
and they weigh in Stage 1's scores through the normaliser, but hold no slot Stage 1 may choose.

Shapes: Hkv KV heads, N pool pages per KV head, M stand-in slots per KV head, d head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StandIn:
    """The stand-in pages' slots: sketched keys and values (Hkv, M, d), and where a slot holds a cold
    token (Hkv, M)."""

    keys: torch.Tensor
    values: torch.Tensor
    alive: torch.Tensor


def standin_pages(mass: torch.Tensor, unread: torch.Tensor, count: int) -> torch.Tensor:
    """Per KV head, the indices (ascending, -1 padded) of at most ``count`` unread pages with the most
    window mass, mass > 0: (Hkv, k). mass (Hkv, N); unread (Hkv, N) bool."""
    k = min(count, mass.shape[1])
    if k == 0:
        return torch.zeros(mass.shape[0], 0, dtype=torch.long, device=mass.device)
    n = mass.shape[1]
    top = torch.topk(torch.where(unread, mass, -1.0), k, dim=1)
    picked = torch.where(top.values > 0, top.indices, n).sort(dim=1).values  # none past the real ones
    return torch.where(picked == n, -1, picked)


def beside(cand: tuple, standin: StandIn | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a turn attends over besides the device: the pages read back (``cand``: keys, values (Hkv, M,
    d), positions, alive, ...) and after them the stand-in's slots: (keys, values, visible), the
    first M slots those of ``cand``."""
    if standin is None:
        return cand[0], cand[1], cand[3]
    keys, values = cand[0], cand[1]
    return (torch.cat([keys, standin.keys.to(keys.dtype)], dim=1), torch.cat([values, standin.values.to(values.dtype)], dim=1),
            torch.cat([cand[3], standin.alive], dim=1))
