"""One layer's decode step of many sessions (Triton), each over its own cache buffers.

Every session's buffers are separate allocations of their own capacity, so the kernels read them
through a table of raw pointers and strides, one int64 row per session (``rocketkv_mt.decode_table``).
A step is a fixed number of launches whatever the number of sessions:

1. ``_append``: each session's new key/value/position goes into its store (and mirror), and the key
   opens or tightens its KT page, in place;
2. for the sessions that read a sparse set: the top-r channels of |q| (torch, one ``topk`` over all
   sessions), ``_page_scores`` (the upper-bound logits over each session's own pages, softmax per
   query head, summed over the group; the last pages and the pinned ones forced), then one ``topk``
   over all sessions' padded scores;
3. ``_attend``: exact attention per (session, KV head) over its chosen pages' tokens, or over all its
   kept tokens for a dense session, split over programs (flash-decoding) and merged by
   ``sparse_decode._merge_splits``.

Same math as ``rocketkv_mt.hsa.hsa_decode`` and dense attention per session (the references).
Shapes: B sessions, Hkv KV heads, G query heads per KV head, d head dim, P pages, r channels.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from rocketkv_mt.decode_table import INDEX, WIDTH

from .common import check_tensors, dot_options
from .sparse_decode import _default_splits, _merge_splits

_LOG2E = 1.4426950408889634
_W = tl.constexpr(WIDTH)
F_K, F_V, F_POS, F_CAP, F_ROW, F_POSITION = (tl.constexpr(INDEX[n]) for n in ("K", "V", "POS", "CAP", "ROW", "POSITION"))
F_MK, F_MV, F_MPOS, F_MCAP, F_MROW = (tl.constexpr(INDEX[n]) for n in ("MK", "MV", "MPOS", "MCAP", "MROW"))
F_BOUNDS, F_BHEAD, F_BROW, F_BPAGE, F_BNEW = (tl.constexpr(INDEX[n]) for n in ("BOUNDS", "BHEAD", "BROW", "BPAGE", "BNEW"))
F_HSA, F_PAGES, F_PAGE_SIZE, F_TOPR, F_KPAGES, F_NLOCAL, F_PINNED, F_NPINNED = (
    tl.constexpr(INDEX[n]) for n in ("HSA", "PAGES", "PAGE_SIZE", "TOPR", "KPAGES", "NLOCAL", "PINNED", "NPINNED")
)


@triton.jit
def _append(
    tab_ptr, k_ptr, v_ptr, D, skb, skh, skd, svb, svh, svd,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = tab_ptr + b * _W
    dtype = k_ptr.dtype.element_ty
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    key = tl.load(k_ptr + b * skb + h * skh + dd * skd, mask=dm, other=0.0)
    val = tl.load(v_ptr + b * svb + h * svh + dd * svd, mask=dm, other=0.0)
    position = tl.load(row + F_POSITION)
    cap = tl.load(row + F_CAP)
    at = h * cap + tl.load(row + F_ROW)
    tl.store(tl.load(row + F_K).to(tl.pointer_type(dtype)) + at * D + dd, key, mask=dm)
    tl.store(tl.load(row + F_V).to(tl.pointer_type(dtype)) + at * D + dd, val, mask=dm)
    tl.store(tl.load(row + F_POS).to(tl.pointer_type(tl.int64)) + at, position)
    # A store or page that is absent (null pointer) gets an empty mask: its channel limit is 0, not D
    # (a limit rather than `& flag`, which the interpreter cannot broadcast).
    mirror = tl.load(row + F_MK)
    m_mask = dd < tl.where(mirror != 0, D, 0)
    m_at = h * tl.load(row + F_MCAP) + tl.load(row + F_MROW)
    tl.store(mirror.to(tl.pointer_type(dtype)) + m_at * D + dd, key, mask=m_mask)
    tl.store(tl.load(row + F_MV).to(tl.pointer_type(dtype)) + m_at * D + dd, val, mask=m_mask)
    tl.store(tl.load(row + F_MPOS).to(tl.pointer_type(tl.int64)) + m_at, position, mask=mirror != 0)
    bounds = tl.load(row + F_BOUNDS)
    brow = tl.load(row + F_BROW)
    hi_ptr = bounds.to(tl.pointer_type(dtype)) + h * tl.load(row + F_BHEAD) + dd * brow + tl.load(row + F_BPAGE)
    lo_ptr = hi_ptr + D * brow
    kt_mask = dd < tl.where(bounds != 0, D, 0)
    opens = tl.load(row + F_BNEW) != 0
    # Compared in fp32 (exact for 16-bit values; the interpreter would compare bf16 bit patterns).
    kf = key.to(tl.float32)
    hi = tl.maximum(tl.load(hi_ptr, mask=kt_mask, other=0.0).to(tl.float32), kf)
    lo = tl.minimum(tl.load(lo_ptr, mask=kt_mask, other=0.0).to(tl.float32), kf)
    tl.store(hi_ptr, tl.where(opens, kf, hi).to(dtype), mask=kt_mask)
    tl.store(lo_ptr, tl.where(opens, kf, lo).to(dtype), mask=kt_mask)


@triton.jit
def _page_scores(
    tab_ptr, q_ptr, ch_ptr, logit_ptr, score_ptr,
    H, G, D, PMAX, RMAX, sqb, sqh, sqg, sqd,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n = b * H + h
    row = tab_ptr + b * _W
    active = tl.load(row + F_HSA) != 0
    pages = tl.where(active, tl.load(row + F_PAGES), 0)  # a dense session scores nothing
    r = tl.where(active, tl.load(row + F_TOPR), 0)
    n_local = tl.load(row + F_NLOCAL)
    n_pinned = tl.where(active, tl.load(row + F_NPINNED), 0)
    brow = tl.load(row + F_BROW)
    bounds = tl.load(row + F_BOUNDS).to(tl.pointer_type(q_ptr.dtype.element_ty)) + h * tl.load(row + F_BHEAD)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    dd = tl.arange(0, BLOCK_D)
    q_row = q_ptr + b * sqb + h * sqh + g[:, None] * sqg
    q_all = tl.load(q_row + dd[None, :] * sqd, mask=gm[:, None] & (dd[None, :] < D), other=0.0).to(tl.float32)
    q_abs = tl.sum(tl.abs(q_all), axis=1)
    hat_abs = tl.zeros((BLOCK_G,), dtype=tl.float32)
    for c0 in range(0, r, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        cm = cc < r
        ch = tl.load(ch_ptr + n * RMAX + cc, mask=cm, other=0)
        q_hat = tl.load(q_row + ch[None, :] * sqd, mask=gm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        hat_abs += tl.sum(tl.abs(q_hat), axis=1)
    # SparQ's scale, 1 / sqrt(d |q_hat|_1 / |q|_1) per query head.
    inv = tl.where(hat_abs > 0, 1.0 / tl.sqrt(tl.maximum(D * hat_abs / tl.maximum(q_abs, 1e-30), 1e-30)), 0.0)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    logits_row = logit_ptr + n * G * PMAX + g[:, None] * PMAX
    for p0 in range(0, pages, BLOCK_P):
        pp = p0 + tl.arange(0, BLOCK_P)
        pm = pp < pages
        acc = tl.zeros((BLOCK_G, BLOCK_P), dtype=tl.float32)
        for c0 in range(0, r, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            cm = cc < r
            ch = tl.load(ch_ptr + n * RMAX + cc, mask=cm, other=0)
            q_hat = tl.load(q_row + ch[None, :] * sqd, mask=gm[:, None] & cm[None, :], other=0.0).to(tl.float32)
            # One bound row per channel for the whole group: the max where the group's q is positive.
            bound_row = tl.where(tl.sum(q_hat, axis=0) > 0, ch, D + ch)
            bound = tl.load(bounds + bound_row[None, :] * brow + pp[:, None], mask=pm[:, None] & cm[None, :],
                            other=0.0).to(tl.float32)
            acc += tl.sum(q_hat[:, None, :] * bound[None, :, :], axis=2)
        logits = tl.where(pm[None, :], acc * inv[:, None], float("-inf"))
        tl.store(logits_row + pp[None, :], logits, mask=gm[:, None] & pm[None, :])
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
        m = m_new
    l = tl.where(gm, l, 1.0)
    m = tl.where(gm, m, 0.0)
    # The logits are read back below in another register layout: every thread's stores must land first.
    tl.debug_barrier()
    scores = score_ptr + n * (PMAX + 1)
    for p0 in range(0, pages, BLOCK_P):
        pp = p0 + tl.arange(0, BLOCK_P)
        pm = pp < pages
        logits = tl.load(logits_row + pp[None, :], mask=gm[:, None] & pm[None, :], other=float("-inf"))
        # Summing the group's softmaxes ranks pages exactly as averaging them does.
        total = tl.sum(tl.where(gm[:, None], tl.exp(logits - m[:, None]) / l[:, None], 0.0), axis=0)
        tl.store(scores + pp, tl.where(pp >= pages - n_local, float("inf"), total), mask=pm)
    tl.debug_barrier()  # the pinned pages' +inf must overwrite their scores, not race them
    pinned = tl.load(row + F_PINNED).to(tl.pointer_type(tl.int64)) + h * n_pinned
    for a0 in range(0, n_pinned, BLOCK_A):
        aa = a0 + tl.arange(0, BLOCK_A)
        am = aa < n_pinned
        page = tl.load(pinned + aa, mask=am, other=0)
        tl.store(scores + page, tl.full((BLOCK_A,), float("inf"), dtype=tl.float32), mask=am)


@triton.jit
def _attend(
    tab_ptr, q_ptr, pages_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr,
    H, G, D, KMAX, per_split, qk_scale,
    sqb, sqh, sqg, sqd, sob, soh, sog, sod,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    row = tab_ptr + b * _W
    dtype = q_ptr.dtype.element_ty
    is_hsa = tl.load(row + F_HSA) != 0
    length = tl.load(row + F_ROW) + 1
    page_size = tl.maximum(tl.load(row + F_PAGE_SIZE), 1)
    total = tl.where(is_hsa, tl.load(row + F_KPAGES) * page_size, length)
    base = h * tl.load(row + F_CAP)
    k_base = tl.load(row + F_K).to(tl.pointer_type(dtype))
    v_base = tl.load(row + F_V).to(tl.pointer_type(dtype))
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    # The group is padded to >= 16 rows so tl.dot's minimum tile holds; padded rows are zeros, never stored.
    q = tl.load(q_ptr + b * sqb + h * sqh + g[:, None] * sqg + dd[None, :] * sqd, mask=gm[:, None] & dm[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    start = split * per_split
    stop = tl.minimum(start + per_split, total)
    paged_stop = tl.where(is_hsa, stop, 0)  # a dense session reads no page list
    for t0 in range(start, stop, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        ok = tt < stop
        page = tl.load(pages_ptr + pid * KMAX + tt // page_size, mask=tt < paged_stop, other=0)
        tok = tl.where(is_hsa, page * page_size + tt % page_size, tt)
        ok = ok & (tok < length)  # the last page may be partial
        kv_mask = ok[:, None] & dm[None, :]
        k = tl.load(k_base + (base + tok)[:, None] * D + dd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + (base + tok)[:, None] * D + dd[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLIT:
        part = (pid * tl.num_programs(1) + split) * G + g
        tl.store(pm_ptr + part, m, mask=gm)
        tl.store(pl_ptr + part, l, mask=gm)
        tl.store(po_ptr + part[:, None] * D + dd[None, :], acc, mask=gm[:, None] & dm[None, :])
    else:
        o_ptr = out_ptr + b * sob + h * soh + g[:, None] * sog + dd[None, :] * sod
        tl.store(o_ptr, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])


def decode_batch(
    table: torch.Tensor,
    rows: np.ndarray,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scaling: float,
    splits: int | None = None,
) -> torch.Tensor:
    """One layer's decode step of B sessions -> (B, Hkv, G, d) in q's dtype.

    table (B, WIDTH) int64 on q's device and ``rows``, its host copy (the launch sizes come from it);
    q (B, Hkv, G, d); k_new/v_new (B, Hkv, d), any strides, in the caches' dtype. The table's pointers
    are trusted (``rocketkv_mt.cache.decode_target`` builds them from live buffers with room for the token).
    ``splits`` forces the token splits per (session, KV head) (None: enough to fill the GPU).
    """
    check_tensors(q, k_new, v_new, table)
    bsz, hkv, g, d = q.shape
    if tuple(table.shape) != (bsz, WIDTH) or rows.shape != (bsz, WIDTH) or k_new.dtype != q.dtype:
        raise ValueError(f"a table of {bsz} rows of {WIDTH} and keys in q's dtype are needed")
    out = torch.empty(bsz, hkv, g, d, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    _append[(bsz, hkv)](table, k_new, v_new, d, *k_new.stride(), *v_new.stride(), BLOCK_D=block_d)
    hsa = rows[:, INDEX["HSA"]] != 0
    kmax = 1
    pages = table  # unread placeholder when no session reads a sparse set
    if hsa.any():
        pmax = int(rows[hsa, INDEX["PAGES"]].max())
        kmax = int(rows[hsa, INDEX["KPAGES"]].max())
        rmax = int(rows[hsa, INDEX["TOPR"]].max())
        channels = torch.topk(q.abs().sum(2), rmax, dim=-1, sorted=True).indices  # (B, Hkv, rmax), best first
        scores = torch.full((bsz * hkv, pmax + 1), float("-inf"), dtype=torch.float32, device=q.device)
        logits = torch.empty(bsz * hkv, g, pmax, dtype=torch.float32, device=q.device)
        block_g = triton.next_power_of_2(g)
        block_c = min(32, triton.next_power_of_2(rmax))
        block_p = max(16, min(128, 4096 // (block_g * block_c)))
        _page_scores[(bsz, hkv)](
            table, q, channels, logits, scores, hkv, g, d, pmax, rmax, *q.stride(),
            BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_D=triton.next_power_of_2(d), BLOCK_A=16,
        )
        # Sorted, so each session's first KPAGES entries are its own top KPAGES (forced pages first).
        pages = torch.topk(scores, kmax, dim=-1, sorted=True).indices
    tokens = np.where(hsa, rows[:, INDEX["KPAGES"]] * rows[:, INDEX["PAGE_SIZE"]], rows[:, INDEX["ROW"]] + 1)
    block_t = 32 if q.dtype == torch.float32 else 64  # register budget of the gathered K/V tiles
    blocks = max(1, triton.cdiv(int(tokens.max()), block_t))
    n_split = min(blocks, splits or _default_splits(bsz * hkv, blocks, q.device))
    per_split = triton.cdiv(blocks, n_split) * block_t
    n_split = max(1, triton.cdiv(int(tokens.max()), per_split))
    block_g = max(16, triton.next_power_of_2(g))
    part_shape = (bsz * hkv, n_split, g)
    pm = torch.empty(part_shape, dtype=torch.float32, device=q.device) if n_split > 1 else out
    pl = torch.empty_like(pm) if n_split > 1 else out
    po = torch.empty(*part_shape, d, dtype=torch.float32, device=q.device) if n_split > 1 else out
    _attend[(bsz * hkv, n_split)](
        table, q, pages, out, po, pm, pl, hkv, g, d, kmax, per_split, scaling * _LOG2E,
        *q.stride(), *out.stride(),
        BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_D=block_d, SPLIT=n_split > 1, num_warps=8, **dot_options(q.dtype),
    )
    if n_split > 1:
        _merge_splits[(bsz * hkv,)](po, pm, pl, out, hkv, g, d, n_split, *out.stride(), BLOCK_G=block_g,
                                    BLOCK_D=block_d)
    return out
