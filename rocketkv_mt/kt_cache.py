"""KT cache: element-wise min and max of the keys of each page, per KV head (torch, or native C on a CPU).

Pages are consecutive runs of ``page_size`` kept tokens, aligned to index 0 of the kept cache;
the last page may be partial. Shapes: Hkv KV heads, L kept tokens, P = ceil(L / page_size) pages.
"""
from __future__ import annotations

import torch

from rocketkv_mt.native import kt_bounds as native_kt

KT_SPARE_PAGES = 64  # pages a decode set's bounds have room for beyond its kept tokens, by default


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


def bounds_buffer(keys: torch.Tensor, page_size: int, spare_pages: int, backend: str = "auto",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """keys (Hkv, L, d) -> (Hkv, 2d, P + spare_pages): per page the max of its keys over their min,
    the page axis last; spare pages zero. On the native C kernel (float32 CPU keys, rows contiguous)
    where ``backend`` allows it ("auto", "native") and it builds here, else in torch: the same values.
    ``out``: a buffer that ``fits`` them, written over instead (every page past P zeroed)."""
    hkv, length, d = keys.shape
    pages = -(-length // page_size)
    if backend in ("auto", "native"):
        if native_kt.supports(keys):
            return native_kt.bounds_buffer(keys, page_size, spare_pages, out)
        if backend == "native":
            raise RuntimeError("the native KT bounds need float32 CPU keys with contiguous rows and a C compiler here")
    kmin, kmax = page_minmax(keys, page_size)
    if out is None:
        out = torch.empty(hkv, 2 * d, pages + spare_pages, dtype=keys.dtype, device=keys.device)
    out[:, :, pages:] = 0
    out[:, :d, :pages] = kmax.transpose(1, 2)
    out[:, d:, :pages] = kmin.transpose(1, 2)
    return out


def fits(buffer: torch.Tensor | None, keys: torch.Tensor, capacity: int) -> bool:
    """Whether ``buffer`` can hold the bounds of ``keys`` (Hkv, L, d) in at least ``capacity`` pages:
    the same heads, channels, dtype and device, contiguous."""
    hkv, _, d = keys.shape
    return (buffer is not None and buffer.shape[:2] == (hkv, 2 * d) and buffer.shape[2] >= capacity
            and buffer.dtype == keys.dtype and buffer.device == keys.device and buffer.is_contiguous())


class KTCache:
    """Page bounds of one layer in one preallocated buffer: (Hkv, 2d, pages) = [max ; min] per page.

    Max and min stacked along the channel axis let HSA score every page with one matmul, and the
    page axis last makes that matmul read the buffer as a plain row-major matrix. ``backend`` picks
    how the bounds are built (``bounds_buffer``).
    """

    def __init__(self, keys: torch.Tensor, page_size: int, spare_pages: int = KT_SPARE_PAGES, *, backend: str = "auto",
                 reuse: "KTCache | None" = None, lead_pages: int = 0):
        self.page_size = page_size
        self.length = keys.shape[1]
        self.head_dim = keys.shape[2]
        # ``reuse``: a cache no longer read (the layer's previous decode set), whose buffer is written
        # over where it holds these pages and half the spare ones: a fresh buffer every layer and turn
        # was faulted in page by page (~0.6 MB a layer of 700 kept tokens; on the load bench a third
        # of the page faults of a round). Stage 1 keeps about as many tokens every turn, so the last
        # turn's buffer mostly fits; a reply past its spare pages grows it (``_grow``). Reused, it keeps
        # room for the first page with ``lead_pages`` (``next_slot``) too.
        self.pages = -(-self.length // page_size)
        old = reuse._bounds if reuse is not None else None
        if fits(old, keys, self.pages + max(spare_pages // 2, lead_pages + 1)):
            spare_pages = old.shape[2] - self.pages
        else:
            old = None
        self._bounds = bounds_buffer(keys, page_size, spare_pages, backend, old)

    @property
    def bounds(self) -> torch.Tensor:
        """(Hkv, 2d, P): per page, the element-wise max of its keys over the min."""
        return self._bounds[:, :, : self.pages]

    @property
    def kmax(self) -> torch.Tensor:
        """(Hkv, P, d), a view."""
        return self._bounds[:, : self.head_dim, : self.pages].transpose(1, 2)

    @property
    def kmin(self) -> torch.Tensor:
        """(Hkv, P, d), a view."""
        return self._bounds[:, self.head_dim :, : self.pages].transpose(1, 2)

    def append(self, key: torch.Tensor) -> None:
        """Add one token's key (Hkv, d): it opens a new page or tightens the last page's bounds in place."""
        d = self.head_dim
        if self.length % self.page_size == 0:
            if self.pages == self._bounds.shape[2]:
                self._grow()
            self._bounds[:, :, self.pages].view(-1, 2, d).copy_(key.unsqueeze(1).expand(-1, 2, -1))
            self.pages += 1
        else:
            last = self._bounds[:, :, self.pages - 1]
            torch.maximum(last[:, :d], key, out=last[:, :d])
            torch.minimum(last[:, d:], key, out=last[:, d:])
        self.length += 1

    @property
    def buffer(self) -> torch.Tensor:
        """The whole bounds buffer (Hkv, 2d, capacity in pages); pages past ``pages`` are spare."""
        return self._bounds

    def next_slot(self, lead: int = 0) -> tuple[int, bool]:
        """(page the next key lands in, whether it opens that page), with room made for a new page:
        what a kernel that appends the key in place needs; ``appended`` then counts it. ``lead``: grow
        that many pages early (layers given different leads grow on different steps, as their stores
        do: ``LayerKV.reserve``)."""
        opens = self.length % self.page_size == 0
        if opens and self.pages + lead >= self._bounds.shape[2]:
            self._grow()
        return (self.pages if opens else self.pages - 1), opens

    def appended(self) -> None:
        """Count one key that a kernel folded into the bounds in place (at ``next_slot``)."""
        if self.length % self.page_size == 0:
            self.pages += 1
        self.length += 1

    def _grow(self) -> None:
        extra = max(64, self._bounds.shape[2] // 2)
        pad = self._bounds.new_zeros(self._bounds.shape[0], self._bounds.shape[1], extra)
        self._bounds = torch.cat([self._bounds, pad], dim=2)

    def nbytes(self) -> int:
        """Bytes of the pages' bounds; from the shapes, without slicing a view (measured after every step)."""
        heads, rows, _ = self._bounds.shape
        return heads * rows * self.pages * self._bounds.element_size()
