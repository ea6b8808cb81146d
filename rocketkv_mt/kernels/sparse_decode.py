"""Sparse decode attention (Triton): one query token per KV group over gathered token indices.

Same math as ``rocketkv_mt.hsa.sparse_attention``, batched over sessions. K/V rows are gathered by index
inside the kernel (no gathered copy in memory); online softmax in fp32. Long token lists are split over
programs (flash-decoding) and the partial results merged by a second kernel.
Shapes: B sessions, Hkv KV heads, G query heads per KV head, d head dim, Lmax cache rows, T gathered tokens.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import check_tensors, dot_options

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_decode(
    q_ptr, k_ptr, v_ptr, tok_ptr, ok_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr,
    H, G, D, T, per_split, qk_scale,
    sqb, sqh, sqg, sqd, skb, skh, skl, skd, svb, svh, svl, svd,
    stb, sth, stt, sab, sah, sat, sob, soh, sog, sod,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    # The group is padded to >= 16 rows so tl.dot's minimum tile holds; padded rows are zeros, never stored.
    q_off = b * sqb + h * sqh + g[:, None] * sqg + dd[None, :] * sqd
    q = tl.load(q_ptr + q_off, mask=gm[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    start = split * per_split
    stop = tl.minimum(start + per_split, T)
    for t0 in range(start, stop, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        ok = tt < stop
        ok = ok & (tl.load(ok_ptr + b * sab + h * sah + tt * sat, mask=ok, other=0) != 0)
        # Invalid slots are never dereferenced, so their indices may be anything.
        idx = tl.load(tok_ptr + b * stb + h * sth + tt * stt, mask=ok, other=0).to(tl.int64)
        kv_mask = ok[:, None] & dm[None, :]
        k = tl.load(k_base + idx[:, None] * skl + dd[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + idx[:, None] * svl + dd[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block must not yield NaN
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
        out = acc / l[:, None]
        o_ptr = out_ptr + b * sob + h * soh + g[:, None] * sog + dd[None, :] * sod
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])


@triton.jit
def _merge_splits(
    po_ptr, pm_ptr, pl_ptr, out_ptr, H, G, D, S,
    sob, soh, sog, sod,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    dd = tl.arange(0, BLOCK_D)
    mask = gm[:, None] & (dd[None, :] < D)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for s in range(0, S):
        part = (pid * S + s) * G + g
        m_s = tl.load(pm_ptr + part, mask=gm, other=float("-inf"))
        l_s = tl.load(pl_ptr + part, mask=gm, other=0.0)
        o_s = tl.load(po_ptr + part[:, None] * D + dd[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_ref)
        c = tl.exp2(m_s - m_ref)
        l = l * a + l_s * c
        acc = acc * a[:, None] + o_s * c[:, None]
        m = m_new
    l = tl.where(gm, l, 1.0)  # padded heads have no mass; keep 0/0 out of them
    o_ptr = out_ptr + b * sob + h * soh + g[:, None] * sog + dd[None, :] * sod
    tl.store(o_ptr, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _default_splits(programs: int, blocks: int, device: torch.device) -> int:
    """Enough programs to cover the GPU about twice; never a split with no block of tokens."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(blocks, math.ceil(2 * sms / max(programs, 1))))


def sparse_attention_batched(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    splits: int | None = None,
) -> torch.Tensor:
    """Exact attention of q (B, Hkv, G, d) over tokens (B, Hkv, T) of keys/values (B, Hkv, Lmax, d) -> (B, Hkv, G, d).

    tokens: integer row indices into the Lmax axis; valid (B, Hkv, T) bool marks the tokens that count
    (invalid entries are never read, so they may hold any index). Output has q's dtype; a row with no
    valid token is NaN, as in the reference. ``splits`` forces the number of token splits per (B, Hkv)
    (None: chosen from the GPU size). Any strides are accepted (e.g. slices of a preallocated cache).
    """
    check_tensors(q, keys, values, tokens, valid)
    bsz, hkv, g, d = q.shape
    t = tokens.shape[-1]
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    block_t = 32 if keys.dtype == torch.float32 else 64  # register budget of the gathered K/V tiles
    blocks = max(1, triton.cdiv(t, block_t))
    n_split = min(blocks, splits or _default_splits(bsz * hkv, blocks, q.device))
    per_split = triton.cdiv(blocks, n_split) * block_t
    n_split = max(1, triton.cdiv(t, per_split))
    block_g = max(16, triton.next_power_of_2(g))
    block_d = max(16, triton.next_power_of_2(d))
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)  # same bytes; avoids relying on i1 pointer loads
    part_shape = (bsz * hkv, n_split, g)
    pm = torch.empty(part_shape, dtype=torch.float32, device=q.device) if n_split > 1 else out
    pl = torch.empty_like(pm) if n_split > 1 else out
    po = torch.empty(*part_shape, d, dtype=torch.float32, device=q.device) if n_split > 1 else out
    _sparse_decode[(bsz * hkv, n_split)](
        q, keys, values, tokens, valid, out, po, pm, pl,
        hkv, g, d, t, per_split, scaling * _LOG2E,
        *q.stride(), *keys.stride(), *values.stride(), *tokens.stride(), *valid.stride(), *out.stride(),
        BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_D=block_d,
        SPLIT=n_split > 1, num_warps=8, **dot_options(keys.dtype),
    )
    if n_split > 1:
        _merge_splits[(bsz * hkv,)](
            po, pm, pl, out, hkv, g, d, n_split, *out.stride(), BLOCK_G=block_g, BLOCK_D=block_d,
        )
    return out


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    splits: int | None = None,
) -> torch.Tensor:
    """One session: q (Hkv, G, d), keys/values (Hkv, L, d), tokens/valid (Hkv, T) -> (Hkv, G, d)."""
    return sparse_attention_batched(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), tokens.unsqueeze(0), valid.unsqueeze(0),
        scaling, splits=splits,
    )[0]
