"""Stage-1 observation-window scoring (Triton), same math as ``rocketkv_mt.stage1.window_scores``.

Two passes so a 128k-token prompt never needs the (Hq, W, L) probability matrix:
1. per window query row, the running max and sum of exp of its causal logits (split over the sequence,
   the splits merged in torch: they are only (Hkv, G*W, S) floats);
2. per tile of prefix keys, the normalised probabilities summed over all G*W rows of the group.
Shapes: Hq query heads, Hkv KV heads, G = Hq // Hkv, W window queries, L keys, d head dim.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import check_tensors, dot_options

_LOG2E = 1.4426950408889634


@triton.jit
def _row_stats(
    q_ptr, k_ptr, m_ptr, l_ptr,
    G, W, L, D, per_split, qk_scale,
    sqh, sqw, sqd, skh, skl, skd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    mb = tl.program_id(1)
    split = tl.program_id(2)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * W + i over the group's window queries
    rm = rows < G * W
    qi = rows % W
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    q_off = (h * G + rows // W) * sqh + qi * sqw
    q = tl.load(q_ptr + q_off[:, None] + dd[None, :] * sqd, mask=rm[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = L - W + qi
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    start = split * per_split
    stop = tl.minimum(start + per_split, L)
    for n0 in range(start, stop, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        km = kp < stop
        k = tl.load(k_ptr + h * skh + kp[:, None] * skl + dd[None, :] * skd, mask=km[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(km[None, :] & (kp[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # split wholly after the query: no NaN
        l = l * tl.exp2(m - m_ref) + tl.sum(tl.exp2(s - m_ref[:, None]), axis=1)
        m = m_new
    out = (h * G * W + rows) * tl.num_programs(2) + split
    tl.store(m_ptr + out, m, mask=rm)
    tl.store(l_ptr + out, l, mask=rm)


@triton.jit
def _prefix_mass(
    q_ptr, k_ptr, lse_ptr, out_ptr,
    G, W, L, D, qk_scale,
    sqh, sqw, sqd, skh, skl, skd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    n_prefix = L - W
    kp = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    km = kp < n_prefix
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    k = tl.load(k_ptr + h * skh + kp[:, None] * skl + dd[None, :] * skd, mask=km[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Every prefix key precedes every window query, so no causal mask is needed here.
    for r0 in range(0, G * W, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rm = rows < G * W
        q_off = (h * G + rows // W) * sqh + (rows % W) * sqw
        q = tl.load(q_ptr + q_off[:, None] + dd[None, :] * sqd, mask=rm[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        lse = tl.load(lse_ptr + h * G * W + rows, mask=rm, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.where(rm[:, None], tl.exp2(s - lse[:, None]), 0.0)
        total += tl.sum(p, axis=0)
    tl.store(out_ptr + h * n_prefix + kp, total, mask=km)


def window_scores(q_win: torch.Tensor, keys: torch.Tensor, scaling: float, splits: int | None = None) -> torch.Tensor:
    """Attention mass of the window on each prefix key, summed over window and GQA group: float32 (Hkv, L - W).

    q_win: (Hq, W, d), the last W queries (they sit at the last W key positions); keys: (Hkv, L, d), L >= W.
    Causal softmax per window query in fp32. ``splits`` forces how many sequence splits the statistics
    pass uses (None: enough to fill the GPU).
    """
    check_tensors(q_win, keys)
    hq, w, d = q_win.shape
    hkv, length, _ = keys.shape
    g = hq // hkv
    out = torch.empty(hkv, length - w, dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out
    # fp32 tiles are halved and use 3xTF32: IEEE fp32 dots of 64x64x128 tiles spill registers.
    block_m, block_n = (32, 64) if keys.dtype == torch.float32 else (64, 64)
    block_d = max(16, triton.next_power_of_2(d))
    dot = dot_options(keys.dtype, fp32_precision="tf32x3")
    qk_scale = scaling * _LOG2E
    row_blocks = triton.cdiv(g * w, block_m)
    seq_blocks = triton.cdiv(length, block_n)
    if splits is None:
        sms = torch.cuda.get_device_properties(keys.device).multi_processor_count if keys.is_cuda else 8
        splits = math.ceil(2 * sms / (hkv * row_blocks))
    per_split = triton.cdiv(seq_blocks, max(1, min(splits, seq_blocks))) * block_n
    n_split = triton.cdiv(length, per_split)
    m = torch.empty(hkv, g * w, n_split, dtype=torch.float32, device=keys.device)
    l = torch.empty_like(m)
    strides = (*q_win.stride(), *keys.stride())
    _row_stats[(hkv, row_blocks, n_split)](
        q_win, keys, m, l, g, w, length, d, per_split, qk_scale, *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=8, **dot,
    )
    # Merge the splits into one log2-sum-exp per row (every row sees key 0, so the max is finite).
    m_row = m.amax(dim=-1, keepdim=True)
    lse = (m_row + torch.log2((l * torch.exp2(m - m_row)).sum(dim=-1, keepdim=True))).squeeze(-1).contiguous()
    _prefix_mass[(hkv, triton.cdiv(length - w, block_n))](
        q_win, keys, lse, out, g, w, length, d, qk_scale, *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=8, **dot,
    )
    return out
