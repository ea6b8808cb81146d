"""The native causal attention of a few query rows over a contiguous history (``attend_rows.c``),
as ``rocketkv_mt.attention_ops.dense_attention`` computes it with SDPA; and the two products of an
attention part (``rocketkv_mt.split_attention``) on the same tiles."""
from __future__ import annotations

import torch

from rocketkv_mt.native import library

HEAD_DIMS = (64, 128)  # what attend_rows.c takes


def takes_rows(rows: torch.Tensor, kv: torch.Tensor) -> bool:
    """True when this file's kernels can take rows (Hkv, M, ·) over kv (Hkv, T, d): float32 on the CPU,
    kv's rows contiguous at one head stride, a head dim they handle, a library built here."""
    d = kv.shape[-1]
    return (
        rows.device.type == "cpu" and rows.dtype == kv.dtype == torch.float32 and d in HEAD_DIMS
        and kv.stride()[1:] == (d, 1) and library() is not None
    )


def supports(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """True when the kernel can take these tensors: what ``takes_rows`` asks of q over keys and over
    values, the same head dim in all three, and keys and values at the same strides."""
    return (
        takes_rows(q, keys) and takes_rows(q, values) and q.shape[-1] == keys.shape[-1]
        and keys.stride() == values.stride()
    )


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (Hq, n, d) the queries of the last n of the L keys; keys/values (Hkv, L, d). Returns (Hq, n, d):
    query i sees keys 0..L - n + i. Pass ``supports`` first."""
    if not supports(q, keys, values):
        raise ValueError("the native row attention needs float32 CPU tensors with contiguous key rows")
    hq, n, d = q.shape
    hkv, length, _ = keys.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = library().rkv_attend_rows(
        q.data_ptr(), hkv, hq // hkv, n, d, keys.data_ptr(), values.data_ptr(), keys.stride(0), length,
        length - n, scaling, out.data_ptr(),
    )
    if rc != 0:  # supports() keeps to the head dims it takes; a kernel that disagrees must not pass garbage on
        raise ValueError(f"the native row attention does not take head dim {d}")
    return out


def part_logits(q: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (Hkv, M, d), keys (Hkv, T, d) -> scaling * q . keys^T (Hkv, M, T). Pass ``takes_rows`` first."""
    if not takes_rows(q, keys):
        raise ValueError("the native part products need float32 CPU tensors with contiguous key rows")
    hkv, m, d = q.shape
    t = keys.shape[1]
    if keys.shape[0] != hkv or keys.shape[2] != d:  # the kernel trusts the shapes: a mismatch would read past them
        raise ValueError(f"keys {tuple(keys.shape)} do not match the rows {tuple(q.shape)}")
    q = q.contiguous()
    out = torch.empty(hkv, m, t, dtype=torch.float32)
    if library().rkv_row_logits(q.data_ptr(), hkv, m, d, keys.data_ptr(), keys.stride(0), t, scaling,
                                out.data_ptr()) != 0:
        raise ValueError(f"the native part products do not take head dim {d}")
    return out


def part_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs (Hkv, M, T), values (Hkv, T, d) -> probs . values (Hkv, M, d). Pass ``takes_rows`` first."""
    if not takes_rows(probs, values):
        raise ValueError("the native part products need float32 CPU tensors with contiguous value rows")
    hkv, m, t = probs.shape
    d = values.shape[-1]
    if values.shape[:2] != (hkv, t):
        raise ValueError(f"values {tuple(values.shape)} do not match the probabilities {tuple(probs.shape)}")
    probs = probs.contiguous()
    out = torch.empty(hkv, m, d, dtype=torch.float32)
    if library().rkv_row_values(probs.data_ptr(), hkv, m, t, values.data_ptr(), values.stride(0), d,
                                out.data_ptr()) != 0:
        raise ValueError(f"the native part products do not take head dim {d}")
    return out


def part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, w: int, own_tail: int,
         visible: torch.Tensor | None, row0: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A whole attention part in one call (``rkv_attend_part``): q (Hq, n, d) float32, the turn's rows
    row0 .. row0 + n - 1, over keys/values (Hkv, T, d) whose last ``own_tail`` are the turn's own
    (causal), ``visible`` (Hkv, T) or None. Returns out (Hq, n, d), lse (Hq, n), and for the last ``w``
    rows (all n where fewer) their numerators exp(logit - top) (Hkv, G, w, T) and tops (Hkv, G, w, 1) (None, None without
    window rows): what ``rocketkv_mt.split_attention.attend_part`` makes of one block of rows. Pass
    ``supports`` first."""
    if not supports(q, keys, values):
        raise ValueError("the native attention part needs float32 CPU tensors with contiguous key rows")
    hq, n, d = q.shape
    hkv, t, _ = keys.shape
    g, w = hq // hkv, min(w, n)
    q = q.contiguous()
    out = torch.empty(hq, n, d, dtype=torch.float32)
    lse = torch.empty(hq, n, dtype=torch.float32)
    wprobs = torch.empty(hkv, g, w, t, dtype=torch.float32)
    wtop = torch.empty(hkv, g, w, 1, dtype=torch.float32)
    scratch = torch.empty(g * n * (t + 2), dtype=torch.float32)
    vis = 0
    if visible is not None:
        visible = visible.to(torch.bool).contiguous()
        vis = visible.data_ptr()
    rc = library().rkv_attend_part(q.data_ptr(), hkv, g, n, d, keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                   t, scaling, row0, own_tail, vis, w, scratch.data_ptr(), out.data_ptr(),
                                   lse.data_ptr(), wprobs.data_ptr(), wtop.data_ptr())
    if rc != 0:
        raise ValueError(f"the native attention part does not take head dim {d}")
    return out, lse, (wprobs if w else None), (wtop if w else None)
