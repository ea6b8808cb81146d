"""Stage 1: SnapKV-style observation-window scoring and per-KV-head token selection (torch reference).

Shapes: Hq query heads, Hkv KV heads, G = Hq // Hkv (GQA group), W window queries, L keys, d head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def window_scores(q_win: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention mass that the observation window puts on each key, summed over the window and the GQA group.

    q_win: (Hq, W, d), the last W queries of the sequence; they sit at the last W key positions.
    keys:  (Hkv, L, d), all keys, in sequence order, L >= W.
    Returns (Hkv, L - W) float32: scores of the keys before the window.

    Each window query sees every key up to its own position (causal softmax, fp32), the columns
    before the window are summed over the W queries and then over the G heads of each KV group.
    """
    hq, w, d = q_win.shape
    hkv, length, _ = keys.shape
    g = hq // hkv
    logits = torch.matmul(q_win.reshape(hkv, g * w, d).float(), keys.float().transpose(1, 2)) * scaling
    logits = logits.view(hkv, g, w, length)
    # Query i of the window sits at position L - W + i; keys after it are masked.
    q_pos = torch.arange(length - w, length, device=keys.device).view(w, 1)
    k_pos = torch.arange(length, device=keys.device).view(1, length)
    logits = logits.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., : length - w]
    return probs.sum(dim=2).sum(dim=1)


def smooth(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Max-pool scores (Hkv, N) along the sequence: kernel ``kernel_size``, stride 1, same length."""
    if kernel_size <= 1 or scores.shape[-1] == 0:
        return scores
    pooled = F.max_pool1d(scores.unsqueeze(0), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled[0, :, : scores.shape[-1]]


def select_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices (Hkv, keep) of the ``keep`` highest scores per row, ascending (position order kept).

    Max pooling makes plateaus of equal scores; ties go to the earlier position so the choice is
    deterministic and the same on every backend. (What a stable descending sort would keep, without
    sorting the row: every score above the k-th highest, then the earliest ones equal to it.)
    """
    keep = min(keep, scores.shape[-1])
    if keep == 0:
        return torch.zeros(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    if bool(torch.isnan(scores).any()):  # NaN ranks first in a sort but equals no threshold: sort then
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep]
        return torch.sort(order, dim=-1).values
    kth = torch.topk(scores, keep, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    room = keep - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (torch.cumsum(tied, dim=-1) <= room))
    # Exactly ``keep`` per row, so the row-major nonzero columns are each row's indices, ascending.
    return torch.nonzero(chosen)[:, 1].view(scores.shape[0], keep)


def snapkv_keep_indices(
    q_win: torch.Tensor, keys: torch.Tensor, prompt_budget: int, kernel_size: int, scaling: float
) -> torch.Tensor:
    """Stage 1 in full: indices (Hkv, prompt_budget) into ``keys`` to keep, window included, ascending.

    q_win: (Hq, W, d) window queries; keys: (Hkv, L, d). Requires L > prompt_budget > W.
    """
    return keep_from_scores(window_scores(q_win, keys, scaling), q_win.shape[1], prompt_budget, kernel_size)


def keep_from_scores(scores: torch.Tensor, window: int, prompt_budget: int, kernel_size: int) -> torch.Tensor:
    """Stage 1's choice from raw window scores (Hkv, L - W): smoothed top (budget - W) plus the window."""
    length = scores.shape[1] + window
    prefix = select_top(smooth(scores, kernel_size), prompt_budget - window)
    tail = torch.arange(length - window, length, device=scores.device).expand(scores.shape[0], window)
    return torch.cat([prefix, tail], dim=1)
