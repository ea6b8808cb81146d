"""KT cache: element-wise min and max of the keys of each page, per KV head (torch reference).

Pages are consecutive runs of ``page_size`` kept tokens, aligned to index 0 of the kept cache;
the last page may be partial. Shapes: Hkv KV heads, L kept tokens, P = ceil(L / page_size) pages.
"""
from __future__ import annotations

import torch


def page_minmax(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys (Hkv, L, d) -> (kmin, kmax), each (Hkv, P, d)."""
    hkv, length, d = keys.shape
    pages = -(-length // page_size)
    pad = pages * page_size - length
    if pad:
        # Padding with copies of the last key changes neither the min nor the max of the last page.
        keys = torch.cat([keys, keys[:, -1:].expand(hkv, pad, d)], dim=1)
    paged = keys.view(hkv, pages, page_size, d)
    return paged.amin(dim=2), paged.amax(dim=2)


class KTCache:
    """Preallocated min/max page buffers for one layer; grows by whole chunks of pages."""

    def __init__(self, keys: torch.Tensor, page_size: int, spare_pages: int = 64):
        self.page_size = page_size
        self.length = keys.shape[1]
        kmin, kmax = page_minmax(keys, page_size)
        hkv, pages, d = kmin.shape
        self._min = torch.empty(hkv, pages + spare_pages, d, dtype=keys.dtype, device=keys.device)
        self._max = torch.empty_like(self._min)
        self._min[:, :pages] = kmin
        self._max[:, :pages] = kmax
        self.pages = pages

    @property
    def kmin(self) -> torch.Tensor:
        return self._min[:, : self.pages]

    @property
    def kmax(self) -> torch.Tensor:
        return self._max[:, : self.pages]

    def append(self, key: torch.Tensor) -> None:
        """Add one token's key (Hkv, d): it opens a new page or tightens the last page's bounds in place."""
        if self.length % self.page_size == 0:
            if self.pages == self._min.shape[1]:
                self._grow()
            self._min[:, self.pages] = key
            self._max[:, self.pages] = key
            self.pages += 1
        else:
            last = self.pages - 1
            torch.minimum(self._min[:, last], key, out=self._min[:, last])
            torch.maximum(self._max[:, last], key, out=self._max[:, last])
        self.length += 1

    def _grow(self) -> None:
        extra = max(64, self._min.shape[1] // 2)
        pad = self._min.new_empty(self._min.shape[0], extra, self._min.shape[2])
        self._min = torch.cat([self._min, pad], dim=1)
        self._max = torch.cat([self._max, pad.clone()], dim=1)

    def nbytes(self) -> int:
        return 2 * self.kmin.numel() * self.kmin.element_size()
