"""Attention of many query rows over keys in any order (Triton): prefill without a score matrix.

A flash-attention forward pass with the GQA group folded into the rows (row r = i * G + j is query
i of head j of the group, so one block of rows covers consecutive positions and the keys are read
once per group, never repeated per query head). Which keys a row sees is given either by a causal
offset (row i sits at position ``q_offset + i``, key j at position j: a turn's tokens over a
contiguous history and themselves) or by positions (key j of head h at ``key_pos[h, j]``, query i
at ``q_pos[i]``: slots stored in any order), optionally restricted to ``alive`` slots. Returns the
output and each row's log-sum-exp, so parts computed separately merge exactly. Nothing of size
(rows x keys) is written to memory; online softmax in fp32.

Shapes: Hq query heads, Hkv KV heads, G = Hq / Hkv, n query rows, T keys, d head dim.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_tensors, dot_options

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_rows(
    q_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, alive_ptr, out_ptr, lse_ptr,
    G, N, T, D, q_offset, qk_scale,
    sqh, sqn, sqd, skh, skt, skd, svh, svt, svd, sph, spt, sah, sat, soh, son, sod,
    POSITIONAL: tl.constexpr, HAS_ALIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    mb = tl.program_id(1)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < G * N
    i = (rows // G).to(tl.int64)
    head = h * G + rows % G
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    q = tl.load(q_ptr + head[:, None] * sqh + i[:, None] * sqn + dd[None, :] * sqd,
                mask=rm[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if POSITIONAL:
        qp = tl.load(qpos_ptr + i, mask=rm, other=-1)
        hi = T
    else:
        qp = q_offset + i
        # Keys past the block's last query are seen by none of its rows: the loop stops there.
        last = tl.minimum(N - 1, (mb * BLOCK_M + BLOCK_M - 1) // G)
        hi = tl.minimum(T, q_offset + last + 1)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        km = kp < hi
        kv_mask = km[:, None] & dm[None, :]
        k = tl.load(k_ptr + h * skh + kp[:, None] * skt + dd[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + h * svh + kp[:, None] * svt + dd[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if POSITIONAL:
            kpos = tl.load(kpos_ptr + h * sph + kp * spt, mask=km, other=0)
            seen = km[None, :] & (kpos[None, :] <= qp[:, None])
        else:
            seen = km[None, :] & (kp[None, :] <= qp[:, None])
        if HAS_ALIVE:
            seen = seen & (tl.load(alive_ptr + h * sah + kp * sat, mask=km, other=0) != 0)[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    # m and l are in base 2 (qk_scale carries log2(e)); the lse is returned in base e.
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, l))) * 0.6931471805599453)
    o_ptr = out_ptr + head[:, None] * soh + i[:, None] * son + dd[None, :] * sod
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])
    tl.store(lse_ptr + head * N + i, lse, mask=rm)


def attend_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    *,
    q_offset: int | None = None,
    q_pos: torch.Tensor | None = None,
    key_pos: torch.Tensor | None = None,
    alive: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (Hq, n, d) over keys/values (Hkv, T, d) -> (out (Hq, n, d), lse (Hq, n) float32).

    Give ``q_offset`` (row i sits at q_offset + i, key j at j) or ``q_pos`` (n,) with ``key_pos``
    (Hkv, T) or (T,); a row sees the keys at or before its position, and only the slots where
    ``alive`` (Hkv, T) is True. A row that sees no key gets out 0 and lse -inf. ``out_dtype``
    defaults to q's. Any strides.
    """
    check_tensors(q, keys, values)
    hq, n, d = q.shape
    hkv, t, _ = keys.shape
    g = hq // hkv
    positional = q_offset is None
    if positional and (q_pos is None or key_pos is None):
        raise ValueError("attend_rows needs q_offset, or q_pos and key_pos")
    out = torch.empty(hq, n, d, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(hq, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if positional:
        q_pos = q_pos.to(torch.int64)
        key_pos = key_pos.to(torch.int64)
        kpos_strides = (0, key_pos.stride(0)) if key_pos.dim() == 1 else key_pos.stride()
    else:
        q_pos, key_pos, kpos_strides = out, out, (0, 0)  # unread placeholders
    if alive is not None:
        alive = alive.view(torch.uint8) if alive.dtype == torch.bool else alive
        alive_strides = alive.stride()
    else:
        alive, alive_strides = out, (0, 0)
    # Sized from sm_90 builds (ptxas): 16-bit tiles of 128 rows x 64 keys on 8 warps and 2 stages hold
    # ~207 registers and 99 KB of shared memory, two programs per SM; fp32 (3xTF32) needs tiles of 32.
    block_m, block_n, warps = (32, 32, 4) if keys.dtype == torch.float32 else (128, 64, 8)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (hkv, triton.cdiv(g * n, block_m))
    _attend_rows[grid](
        q, keys, values, key_pos, q_pos, alive, out, lse,
        g, n, t, d, 0 if positional else int(q_offset), scaling * _LOG2E,
        *q.stride(), *keys.stride(), *values.stride(), *kpos_strides, *alive_strides, *out.stride(),
        POSITIONAL=positional, HAS_ALIVE=alive is not out,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=2,
        **dot_options(keys.dtype, fp32_precision="tf32x3"),
    )
    return out, lse
