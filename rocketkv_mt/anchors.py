"""Anchor pages: the pages a turn's observation window scored highest, pinned for that turn's decode.

Stage 1 has just measured, with the turn's own question, which kept tokens matter; HSA's per-step
upper-bound scores can still rank those pages below others. Pinning the best few keeps them in every
decode step's set (within the topk budget, so the read cost is unchanged).

Shapes: Hkv KV heads, L kept tokens, P = ceil(L / page_size) pages, A anchor pages.
"""
from __future__ import annotations

import torch


def anchor_pages(token_scores: torch.Tensor, page_size: int, n_pages: int) -> torch.Tensor | None:
    """token_scores (Hkv, L) of the kept tokens, in kept order -> page indices (Hkv, A), ascending.

    A page scores the highest of its tokens' scores; None when ``n_pages`` is 0 or nothing is kept.
    """
    hkv, length = token_scores.shape
    if n_pages <= 0 or length == 0:
        return None
    pages = -(-length // page_size)
    padded = token_scores.new_full((hkv, pages * page_size), float("-inf"))
    padded[:, :length] = token_scores
    per_page = padded.view(hkv, pages, page_size).amax(dim=-1)
    chosen = torch.topk(per_page, min(n_pages, pages), dim=-1, sorted=False).indices
    return torch.sort(chosen, dim=-1).values


def kept_scores(scores: torch.Tensor, prefix_idx: torch.Tensor, window: int) -> torch.Tensor:
    """Scores (Hkv, L - W) of a history's prefix -> (Hkv, len(prefix_idx) + W) for the kept tokens.

    The window's own tokens get 0: the local window of HSA covers them while the reply starts.
    """
    prefix = torch.gather(scores, 1, prefix_idx)
    return torch.cat([prefix, prefix.new_zeros(prefix.shape[0], window)], dim=1)
