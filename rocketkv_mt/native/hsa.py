"""The native CPU kernel: ``hsa_decode`` (the signature and result of ``rocketkv_mt.hsa.hsa_decode``) and
``decode_batch`` (one layer's decode step of many sessions, ``rocketkv_mt.cache.decode_target``)."""
from __future__ import annotations

import math

import numpy as np
import torch

from rocketkv_mt.decode_table import WIDTH
from rocketkv_mt.hsa import local_pages, pages_read
from rocketkv_mt.native import library


def supports(q: torch.Tensor) -> bool:
    """True when the kernel can take this call: float32 CPU tensors and a library built here."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and library() is not None


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
    """q (Hkv, G, d); key_buf/value_buf (Hkv, C, d) contiguous; bounds (Hkv, 2d, P) with unit stride
    along P -> (Hkv, G, d). See ``rocketkv_mt.hsa.hsa_decode``; pass ``supports(q)`` first."""
    hkv, g, d = q.shape
    pages = bounds.shape[2]
    # The kernel trusts these: a mismatch would read or write outside the buffers, not raise.
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, key_buf, value_buf, bounds)):
        raise ValueError("the native hsa_decode takes float32 CPU tensors only")
    if key_buf.shape != value_buf.shape or key_buf.shape[0] != hkv or key_buf.shape[2] != d:
        raise ValueError(f"key/value buffers {tuple(key_buf.shape)} do not match q {tuple(q.shape)}")
    if tuple(bounds.shape[:2]) != (hkv, 2 * d) or not 0 < length <= key_buf.shape[1]:
        raise ValueError(f"bounds {tuple(bounds.shape)} or length {length} do not match the buffers")
    if pages * page_size < length or (pages - 1) * page_size >= length:
        raise ValueError(f"{pages} pages of {page_size} do not cover exactly {length} tokens")
    if not (key_buf.is_contiguous() and value_buf.is_contiguous() and bounds.stride(2) == 1):
        raise ValueError("hsa_decode needs contiguous key/value buffers and bounds with unit stride along pages")
    if bounds.stride(0) != bounds.shape[1] * bounds.stride(1):
        raise ValueError("bounds rows must be evenly strided across heads")
    n_local = local_pages(length, page_size, local_window)
    n_pinned = 0
    if pinned is not None:
        if pinned.shape[0] != hkv or (pinned.numel() and not 0 <= int(pinned.min()) <= int(pinned.max()) < pages):
            raise ValueError(f"pinned pages must be (Hkv, A) indices below {pages}")
        pinned = pinned.to(torch.int64).contiguous()
        n_pinned = pinned.shape[1]
    k_pages = pages_read(math.ceil(topk / page_size), n_local + n_pinned, pages)
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = library().rkv_hsa_decode(
        q.data_ptr(), key_buf.data_ptr(), value_buf.data_ptr(), bounds.data_ptr(),
        None if pinned is None else pinned.data_ptr(), out.data_ptr(),
        hkv, g, d, key_buf.shape[1], length, pages, bounds.stride(0), bounds.stride(1),
        page_size, topr, k_pages, n_local, n_pinned, scaling,
    )
    if rc != 0:
        raise MemoryError("native hsa_decode could not allocate its scratch memory")
    return out


def decode_batch(table: np.ndarray, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scaling: float) -> torch.Tensor:
    """One layer's decode step for B sessions on the native kernel -> (B, Hkv, G, d).

    table (B, ``decode_table.WIDTH``) int64 rows (see ``rocketkv_mt.decode_table``); q (B, Hkv, G, d),
    k_new/v_new (B, Hkv, d), float32 CPU. The rows' pointers are trusted: the caller built them from
    live buffers with room for the token (``rocketkv_mt.cache.decode_target``).
    """
    bsz, hkv, g, d = q.shape
    if table.dtype != np.int64 or table.shape != (bsz, WIDTH) or not table.flags.c_contiguous:
        raise ValueError(f"a decode table of {bsz} contiguous int64 rows of {WIDTH} is needed, not {table.shape}")
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, k_new, v_new)):
        raise ValueError("the native decode_batch takes float32 CPU tensors only")
    if k_new.shape != (bsz, hkv, d) or v_new.shape != k_new.shape:
        raise ValueError(f"new keys {tuple(k_new.shape)} / values {tuple(v_new.shape)} do not match q {tuple(q.shape)}")
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    out = torch.empty_like(q)
    rc = library().rkv_decode_batch(
        table.ctypes.data, bsz, WIDTH, q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), out.data_ptr(),
        hkv, g, d, scaling,
    )
    if rc == -2:
        raise ValueError("the native kernel reads another decode table layout; rebuild it")
    if rc != 0:
        raise MemoryError("native decode_batch could not allocate its scratch memory")
    return out
