"""Which cold pages a new turn fetches: the ones whose key digests promise the highest Stage-1 score.

Stage 1 scores a token by the softmax mass the observation window puts on it. A page's digest is the
centroid of its cold keys; the page is scored as a token at its centroid would be: each window
query's exp(q·c·scale − lse_device), summed over the window and the query heads of the KV group,
where lse_device is the query's log-sum-exp over the keys the device holds (the primary set and the
new turn). The pages with the highest scores are fetched.

Measured on the bundled model (``mt_2k``, first 2 conversations, exhaustive re-selection as the
reference, per KV head and layer): with half the prompt budget's worth of pages, the centroid
ranking held 75.6% of the cold tokens that exhaustive re-admitted, the per-channel min/max bound
(Quest's) 65.8%. The bound is safe
but loose for 32 keys of 64 channels: a page with one outlier key ranks as high as a page of them.

Shapes: Hq query heads, Hkv KV heads, g = Hq / Hkv, w window queries, N cold pages per head, d head dim.
"""
from __future__ import annotations

import math

import torch

# exp() of a score far above the normaliser is still a ranking, not a probability: cap it before exp.
_MAX_LOG_RATIO = 60.0


def page_scores(q_win: torch.Tensor, centroids: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """Stage-1 score of a token at each page's centroid: (Hkv, N) float32.

    q_win (Hq, w, d); centroids (Hkv, N, d); lse (Hkv, g*w): each window row's log-sum-exp over the
    keys on the device, rows in q_win.reshape(Hkv, g*w, d) order. Cold pages are history, so every
    window query sees them."""
    hq, w, d = q_win.shape
    hkv = centroids.shape[0]
    q = q_win.reshape(hkv, (hq // hkv) * w, d).float()
    logits = torch.matmul(q, centroids.float().transpose(1, 2)) * scaling
    return torch.exp((logits - lse.unsqueeze(-1)).clamp(max=_MAX_LOG_RATIO)).sum(dim=1)


def pages_per_head(fraction: float, prompt_budget: int, page_tokens: int) -> int:
    """Cold pages a ``digest`` turn reads per KV head and layer: ``fraction`` of the prompt budget's tokens."""
    return math.ceil(fraction * prompt_budget / page_tokens)


def candidate_pages(scores: torch.Tensor, live: torch.Tensor, per_head: int) -> list[torch.Tensor]:
    """Per head, the indices (ascending) of at most ``per_head`` live pages with the highest scores."""
    masked = scores.masked_fill(~live, float("-inf"))
    k = min(per_head, masked.shape[1])
    top = torch.topk(masked, k, dim=1).indices if k else masked.new_zeros(masked.shape[0], 0, dtype=torch.long)
    out = []
    for i in range(scores.shape[0]):
        chosen = top[i][live[i].gather(0, top[i])]
        out.append(chosen.sort().values.cpu())
    return out
