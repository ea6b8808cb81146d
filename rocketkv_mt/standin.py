"""The cold pages a tiered turn scores but does not read, stood in for in its window rows' attention.

A ``digest`` turn with a key sketch scores every token of a pool of cold pages (``cold_select``)
and reads back only the pages Stage 1's choice needs. An ``exhaustive`` turn attends over every
cold token; a digest turn's window rows attend over what it read, so where an unread page carries
much of a row's softmax mass, the row misses both that mass and that page's values. Measured, a
turn needs those values token by token: a page's mean value in their place blurs the one token a
question turns to. So each page also keeps a value sketch (``tiers.cold_layer``), and the unread pool
pages carrying the most window mass (``PoolScores.mass``) join the window rows' softmax as one more
part, over their sketched keys and values: a few bits a channel of each, not the page.

Shapes: Hq query heads, Hkv KV heads, n turn rows, w window rows (the last w of n), M stand-in
slots per KV head, d head dim.
"""
from __future__ import annotations

import torch

from rocketkv_mt.split_attention import Part, attend_part


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


def standin_part(q_win: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, alive: torch.Tensor, scaling: float,
                 n: int) -> Part:
    """The stand-in pages as one attention part over the turn's n rows: the window rows q_win (Hq, w, d)
    over their sketched keys and values (Hkv, M, d), slots where ``alive`` (Hkv, M) holds a cold token;
    the rows before the window see nothing here (lse -inf, out 0), their logits over the pool were
    never computed."""
    hq, w, d = q_win.shape
    part = attend_part(q_win, keys, values, scaling, 0, visible=alive)
    if n == w:
        return part
    out = torch.zeros(hq, n, d, dtype=part.out.dtype, device=q_win.device)
    lse = torch.full((hq, n), float("-inf"), dtype=part.lse.dtype, device=q_win.device)
    out[:, n - w :], lse[:, n - w :] = part.out, part.lse
    return Part(out, lse, None, None)
