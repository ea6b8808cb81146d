"""HSA page scoring over the KT cache (Triton), same math as ``rocketkv_mt.hsa.page_scores``.

Shapes: N score rows (KV heads, or sessions x KV heads flattened), G query heads per KV head, d head dim,
P pages, r kept channels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_tensors


@triton.jit
def _page_logits(
    q_ptr, kmin_ptr, kmax_ptr, ch_ptr, logit_ptr, bmax_ptr, bsum_ptr,
    G, P, R, D, NB,
    sqn, sqg, sqd, skn, skp, skd, sxn, sxp, sxd, scn, scr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    dd = tl.arange(0, BLOCK_D)
    q_row = q_ptr + n * sqn + g[:, None] * sqg
    q_all = tl.load(q_row + dd[None, :] * sqd, mask=gm[:, None] & (dd[None, :] < D), other=0.0).to(tl.float32)
    q_abs = tl.sum(tl.abs(q_all), axis=1)
    pp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = pp < P
    acc = tl.zeros((BLOCK_G, BLOCK_P), dtype=tl.float32)
    hat_abs = tl.zeros((BLOCK_G,), dtype=tl.float32)
    for c0 in range(0, R, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        cm = cc < R
        ch = tl.load(ch_ptr + n * scn + cc * scr, mask=cm, other=0)
        q_hat = tl.load(q_row + ch[None, :] * sqd, mask=gm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        hat_abs += tl.sum(tl.abs(q_hat), axis=1)
        # One sign per channel for the whole group (sign of the summed q): all heads read the same bound.
        positive = tl.sum(q_hat, axis=0) > 0
        kmask = pm[:, None] & cm[None, :]
        k_hi = tl.load(kmax_ptr + n * sxn + pp[:, None] * sxp + ch[None, :] * sxd, mask=kmask, other=0.0)
        k_lo = tl.load(kmin_ptr + n * skn + pp[:, None] * skp + ch[None, :] * skd, mask=kmask, other=0.0)
        bound = tl.where(positive[None, :], k_hi.to(tl.float32), k_lo.to(tl.float32))
        # G is a handful of heads: a broadcast reduce avoids padding the group to a 16-row dot.
        acc += tl.sum(q_hat[:, None, :] * bound[None, :, :], axis=2)
    scale = tl.sqrt(D * hat_abs / tl.maximum(q_abs, 1e-30))
    logits = acc / tl.maximum(scale, 1e-30)[:, None]
    logits = tl.where(pm[None, :], logits, float("-inf"))
    tl.store(logit_ptr + n * G * P + g[:, None] * P + pp[None, :], logits, mask=gm[:, None] & pm[None, :])
    # Per-block softmax statistics; the second kernel merges them across blocks.
    bmax = tl.max(logits, axis=1)
    bsum = tl.sum(tl.exp(logits - bmax[:, None]), axis=1)
    stat = n * NB * G + pb * G + g
    tl.store(bmax_ptr + stat, bmax, mask=gm)
    tl.store(bsum_ptr + stat, bsum, mask=gm)


@triton.jit
def _page_softmax_mean(
    logit_ptr, bmax_ptr, bsum_ptr, out_ptr, G, P, NB,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    nb = tl.arange(0, BLOCK_NB)
    smask = (nb[:, None] < NB) & gm[None, :]
    stat = n * NB * G + nb[:, None] * G + g[None, :]
    bmax = tl.load(bmax_ptr + stat, mask=smask, other=float("-inf"))
    bsum = tl.load(bsum_ptr + stat, mask=smask, other=0.0)
    m = tl.where(gm, tl.max(bmax, axis=0), 0.0)  # padded heads get 0 so no -inf - -inf below
    total = tl.sum(bsum * tl.exp(bmax - m[None, :]), axis=0)
    total = tl.where(gm, total, 1.0)
    pp = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = pp < P
    mask = gm[:, None] & pm[None, :]
    logits = tl.load(logit_ptr + n * G * P + g[:, None] * P + pp[None, :], mask=mask, other=float("-inf"))
    probs = tl.where(mask, tl.exp(logits - m[:, None]) / total[:, None], 0.0)
    tl.store(out_ptr + n * P + pp, tl.sum(probs, axis=0) / G, mask=pm)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Approximate attention mass of each page per KV head: float32 (Hkv, P).

    q (Hkv, G, d); kmin/kmax (Hkv, P, d); channels (Hkv, r) integer channel indices.
    Batched sessions of equal P: pass them flattened to (B*Hkv, ...) and view the result back.
    Upper bound and SparQ scale are computed in the first kernel; the page softmax and the group mean
    in the second (the first also emits per-block softmax statistics so pages can be split over programs).
    """
    check_tensors(q, kmin, kmax, channels)
    n, g, d = q.shape
    p = kmin.shape[1]
    r = channels.shape[1]
    out = torch.empty(n, p, dtype=torch.float32, device=q.device)
    if n == 0 or p == 0:
        return out
    block_g = triton.next_power_of_2(g)
    block_c = min(32, triton.next_power_of_2(r))
    # Keep the (G, P, C) broadcast tile near 4k elements so it stays in registers.
    block_p = max(16, min(128, 4096 // (block_g * block_c)))
    nb = triton.cdiv(p, block_p)
    logits = torch.empty(n, g, p, dtype=torch.float32, device=q.device)
    bmax = torch.empty(n, nb, g, dtype=torch.float32, device=q.device)
    bsum = torch.empty_like(bmax)
    _page_logits[(n, nb)](
        q, kmin, kmax, channels, logits, bmax, bsum,
        g, p, r, d, nb,
        *q.stride(), *kmin.stride(), *kmax.stride(), *channels.stride(),
        BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_D=triton.next_power_of_2(d),
    )
    _page_softmax_mean[(n, nb)](
        logits, bmax, bsum, out, g, p, nb,
        BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_NB=triton.next_power_of_2(nb),
    )
    return out
