"""Stage 2: Hybrid Sparse Attention for one decode query (torch reference).

Shapes: Hkv KV heads, G query heads per KV head, d head dim, L kept tokens, P pages, r kept channels.
"""
from __future__ import annotations

import math

import torch

from rocketkv_mt.take_rows import take_rows


def select_channels(q: torch.Tensor, topr: int) -> torch.Tensor:
    """q (Hkv, G, d) -> indices (Hkv, r) of the channels with the largest |q| summed over the group."""
    return torch.topk(q.abs().sum(dim=1), min(topr, q.shape[-1]), dim=-1).indices


def page_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, channels: torch.Tensor
) -> torch.Tensor:
    """Approximate attention mass of each page, per KV head: (Hkv, P).

    q (Hkv, G, d); kmin/kmax (Hkv, P, d); channels (Hkv, r).
    Over the kept channels, each head's upper bound q_c * (max_c if the group's q_c > 0 else min_c)
    is scaled as in SparQ (divided by sqrt(d * sum|q_hat| / sum|q|)), soft-maxed over pages and
    averaged over the group's heads.
    """
    d = q.shape[-1]
    qf = q.float()
    q_hat = torch.gather(qf, 2, channels.unsqueeze(1).expand(-1, qf.shape[1], -1))  # (Hkv, G, r)
    idx = channels.unsqueeze(1).expand(-1, kmin.shape[1], -1)
    kmin_hat = torch.gather(kmin.float(), 2, idx)  # (Hkv, P, r)
    kmax_hat = torch.gather(kmax.float(), 2, idx)
    # One sign per channel for the whole group, so every head of the group reads the same bound.
    positive = q_hat.sum(dim=1, keepdim=True) > 0  # (Hkv, 1, r)
    q_pos = torch.where(positive, q_hat, 0.0)
    q_neg = q_hat - q_pos
    logits = torch.matmul(q_pos, kmax_hat.transpose(1, 2)) + torch.matmul(q_neg, kmin_hat.transpose(1, 2))
    scale = torch.sqrt(d * q_hat.abs().sum(-1, keepdim=True) / qf.abs().sum(-1, keepdim=True).clamp_min(1e-30))
    probs = torch.softmax(logits / scale.clamp_min(1e-30), dim=-1)  # (Hkv, G, P)
    return probs.mean(dim=1)


def local_pages(length: int, page_size: int, local_window: int) -> int:
    """Pages holding the last ``local_window`` of ``length`` kept tokens (0 when the window is 0)."""
    if local_window <= 0 or length <= 0:
        return 0
    pages = -(-length // page_size)
    return pages - max(0, length - local_window) // page_size


def pin(scores: torch.Tensor, n_local: int, pinned: torch.Tensor | None) -> int:
    """Give the last ``n_local`` pages and the ``pinned`` (Hkv, A) pages an infinite score, in place.

    Returns how many pages that forces into the selection at most.
    """
    if n_local:
        scores[:, scores.shape[-1] - n_local :] = float("inf")
    if pinned is None:
        return n_local
    scores.scatter_(1, pinned, float("inf"))
    return n_local + pinned.shape[1]


def pages_read(k_pages: int, forced: int, pages: int) -> int:
    """Pages attended per KV head: ``k_pages``, unless the ``forced`` ones alone are more; never more than exist."""
    return min(max(k_pages, forced), pages)


def select_pages(
    scores: torch.Tensor, k_pages: int, n_local: int = 0, pinned: torch.Tensor | None = None
) -> torch.Tensor:
    """scores (Hkv, P) -> page indices (Hkv, k), ascending; all pages when P <= k.

    The last ``n_local`` pages and the ``pinned`` pages (Hkv, A) are always chosen and count within
    k: the reply's own recent tokens carry the context its next token continues, the pinned ones are
    what the turn's window found, and an upper-bound score can rank either low.
    """
    scores = scores.clone()
    k = pages_read(k_pages, pin(scores, n_local, pinned), scores.shape[-1])
    idx = torch.topk(scores, k, dim=-1, sorted=False).indices
    return torch.sort(idx, dim=-1).values


def page_tokens(pages: torch.Tensor, page_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (Hkv, k * page_size) of the selected pages and a mask of those < length."""
    offs = torch.arange(page_size, device=pages.device)
    tokens = (pages.unsqueeze(-1) * page_size + offs).flatten(1)
    valid = tokens < length
    return tokens.clamp_max(length - 1), valid


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Exact attention of q (Hkv, G, d) over the gathered tokens (Hkv, T) of keys/values (Hkv, L, d)."""
    k_sel = take_rows(keys, tokens)
    v_sel = take_rows(values, tokens)
    logits = torch.matmul(q.float(), k_sel.float().transpose(1, 2)) * scaling  # (Hkv, G, T)
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, v_sel.float()).to(q.dtype)


def hsa_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_size: int,
    topr: int,
    topk: int,
    scaling: float,
    score_pages=None,
    attend=None,
    local_window: int = 0,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """HSA for one decode query: q (Hkv, G, d) over kept keys/values (Hkv, L, d) -> (Hkv, G, d).

    The pages of the last ``local_window`` kept tokens and the ``pinned`` pages (Hkv, A) are always
    among the topk tokens' worth.
    ``score_pages``/``attend`` replace ``page_scores``/``sparse_attention`` (e.g. by Triton kernels).
    """
    channels = select_channels(q, topr)
    scores = (score_pages or page_scores)(q, kmin, kmax, channels)
    n_local = local_pages(keys.shape[1], page_size, local_window)
    pages = select_pages(scores, math.ceil(topk / page_size), n_local, pinned)
    tokens, valid = page_tokens(pages, page_size, keys.shape[1])
    return (attend or sparse_attention)(q, keys, values, tokens, valid, scaling)


def hsa_decode(
    q: torch.Tensor,
    key_buf: torch.Tensor,
    value_buf: torch.Tensor,
    length: int,
    bounds: torch.Tensor,
    page_size: int,
    topr: int,
    topk: int,
    scaling: float,
    local_window: int = 0,
    pinned: torch.Tensor | None = None,
) -> torch.Tensor:
    """``hsa_attention`` with as few torch ops as possible: the CPU production path.

    q (Hkv, G, d); key_buf/value_buf (Hkv, C, d) contiguous buffers whose first ``length`` tokens
    are the kept ones and C >= pages * page_size; bounds (Hkv, 2d, P) = [max ; min] per page, rows
    of P contiguous values. Returns (Hkv, G, d).

    Each kept channel needs one bound row only (the max where the group's q is positive, else the
    min), so those r rows are copied out whole and scored by one (G, r) x (r, P) matmul per head;
    the selected pages' tokens are read straight from the buffers by row index.
    """
    hkv, g, d = q.shape
    pages = bounds.shape[2]
    r = min(topr, d)
    mag = q.abs()
    channels = torch.topk(mag.sum(1), r, dim=-1, sorted=False).indices  # (Hkv, r)
    positive = torch.gather(q.sum(1), 1, channels) > 0
    head_rows = torch.arange(0, hkv * 2 * d, 2 * d, device=q.device).unsqueeze(1)
    rows = (channels + head_rows + torch.where(positive, 0, d)).view(-1)
    bound = bounds.flatten(0, 1).index_select(0, rows).view(hkv, r, pages)
    q_hat = torch.gather(q, 2, channels.unsqueeze(1).expand(-1, g, -1))  # (Hkv, G, r)
    inv_scale = torch.rsqrt(d * q_hat.abs().sum(-1, keepdim=True) / mag.sum(-1, keepdim=True).clamp_min(1e-30))
    logits = torch.bmm(q_hat * inv_scale, bound)
    # Summing the group's softmaxes ranks pages exactly as averaging them does.
    scores = torch.softmax(logits.float(), dim=-1).sum(1)
    forced = pin(scores, local_pages(length, page_size, local_window), pinned)
    k_pages = pages_read(math.ceil(topk / page_size), forced, pages)
    chosen = torch.topk(scores, k_pages, dim=-1, sorted=False).indices
    cap = key_buf.shape[1]
    offs = torch.arange(page_size, device=q.device)
    tokens = (chosen.unsqueeze(-1) * page_size + offs).view(hkv, k_pages * page_size)
    token_rows = (tokens + (head_rows // (2 * d)) * cap).view(-1)
    k_sel = key_buf.view(hkv * cap, d).index_select(0, token_rows).view(hkv, -1, d)
    v_sel = value_buf.view(hkv * cap, d).index_select(0, token_rows).view(hkv, -1, d)
    att = torch.bmm(q, k_sel.transpose(1, 2)) * scaling  # (Hkv, G, T)
    if length % page_size:
        att.masked_fill_((tokens >= length).unsqueeze(1), float("-inf"))
    return torch.bmm(torch.softmax(att, dim=-1), v_sel)
