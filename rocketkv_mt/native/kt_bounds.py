"""The native KT page bounds (``kt_bounds.c``): ``rocketkv_mt.kt_cache.bounds_buffer`` in one pass."""
from __future__ import annotations

import torch

from rocketkv_mt.native import library

MAX_D = 256


def supports(keys: torch.Tensor) -> bool:
    """True when the kernel can take these keys: float32 on the CPU, rows contiguous, a head dim up to
    ``MAX_D``, a library built here."""
    return (keys.device.type == "cpu" and keys.dtype == torch.float32 and keys.dim() == 3
            and keys.stride(2) == 1 and 1 <= keys.shape[2] <= MAX_D and library() is not None)


def bounds_buffer(keys: torch.Tensor, page_size: int, spare_pages: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """keys (Hkv, L, d) -> (Hkv, 2d, P + spare_pages) with P = ceil(L / page_size): per page the max of
    its keys over their min, page axis last, spare pages zero; into ``out`` (contiguous float32 CPU,
    (Hkv, 2d, at least that many pages)) where given. Pass ``supports`` first."""
    if not supports(keys):
        raise ValueError("the native KT bounds need float32 CPU keys with contiguous rows and a C compiler here")
    hkv, length, d = keys.shape
    pages = -(-length // page_size)
    if out is None:
        out = torch.empty(hkv, 2 * d, pages + spare_pages, dtype=torch.float32)
    elif not (out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous()
              and out.shape[:2] == (hkv, 2 * d) and out.shape[2] >= pages + spare_pages):
        raise ValueError(f"a bounds buffer {tuple(out.shape)} cannot hold {pages} pages of {hkv} heads")
    rc = library().rkv_page_bounds(keys.data_ptr(), hkv, length, d, keys.stride(0), keys.stride(1), page_size,
                                   out.data_ptr(), out.shape[2])
    if rc != 0:
        raise ValueError(f"the native KT bounds do not take head dim {d} or page size {page_size}")
    return out
