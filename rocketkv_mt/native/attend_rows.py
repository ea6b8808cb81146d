"""The native causal attention of a few query rows over a contiguous history (``attend_rows.c``),
as ``rocketkv_mt.attention_ops.dense_attention`` computes it with SDPA."""
from __future__ import annotations

import torch

from rocketkv_mt.native import library

HEAD_DIMS = (64, 128)  # what attend_rows.c takes


def supports(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """True when the kernel can take these tensors: float32 on the CPU, each head's keys and values
    contiguous rows at one head stride, a head dim it handles, a library built here."""
    d = q.shape[-1]
    return (
        q.device.type == "cpu" and q.dtype == keys.dtype == values.dtype == torch.float32
        and d in HEAD_DIMS and keys.stride() == values.stride() and keys.stride()[1:] == (d, 1)
        and library() is not None
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
