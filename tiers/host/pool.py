"""The host tier's memory: one tensor per page field with a slot axis, and which of its slots are free.

The pool is allocated whole when its layout is known (the first page: every later page has the same
fields, shapes and dtypes), pinned when CUDA is present so copies to the device can be asynchronous,
and never grows: ``max_slots`` is a hard bound. Reads gather into new tensors, so nothing returned
aliases a slot that a later write may reuse. No lock of its own: only ``tiers.host.tier.HostTier``
calls it, under the tier's lock, and makes room or refuses a store when no slot is free.
"""
from __future__ import annotations

import torch

from tiers.base import PageBatch


class HostPool:
    def __init__(self, capacity_bytes: int, pin: bool, page_bytes: int | None = None):
        """``page_bytes``: one page's size if known before the first page (admission then knows the bound)."""
        self.capacity_bytes, self.pin = capacity_bytes, pin
        self.page_bytes = page_bytes or 0
        self._fields: PageBatch = {}
        self._free: list[int] = []
        self._high = 0  # slots handed out at least once; those from here up were never touched

    @property
    def max_slots(self) -> int:
        return max(1, self.capacity_bytes // self.page_bytes) if self.page_bytes else 0

    def lay_out(self, batch: PageBatch) -> None:
        """Check a batch of pages (a leading page axis) against the pool's layout; the first sets it and allocates the
        whole bound (growing batch by batch copied it again and again; untouched rows cost no memory unless pinned)."""
        nbytes = sum(t[0].numel() * t.element_size() for t in batch.values())
        if not self._fields:
            if self.page_bytes and nbytes != self.page_bytes:
                raise ValueError(f"a page of {nbytes} bytes in a host tier laid out for {self.page_bytes}")
            self.page_bytes = nbytes
            self._fields = {k: torch.empty(self.max_slots, *t.shape[1:], dtype=t.dtype, pin_memory=self.pin)
                            for k, t in batch.items()}
            return
        for name, t in batch.items():
            ref = self._fields.get(name)
            if ref is None or ref.shape[1:] != t.shape[1:] or ref.dtype != t.dtype or len(batch) != len(self._fields):
                raise ValueError("every page in the host tier has the same fields, shapes and dtypes")

    # --- slots -------------------------------------------------------------------------------
    def free_count(self) -> int:
        return len(self._free) + self.max_slots - self._high

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when fewer are free)."""
        slots = [self._free.pop() for _ in range(min(n, len(self._free)))]
        fresh = max(0, min(n - len(slots), self.max_slots - self._high))
        slots += range(self._high, self._high + fresh)
        self._high += fresh
        return slots

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)

    # --- bytes -------------------------------------------------------------------------------
    def write(self, slots: list[int], batch: PageBatch) -> None:
        index = torch.tensor(slots, dtype=torch.long)
        for name, t in batch.items():
            self._fields[name].index_copy_(0, index, t.to(self._fields[name].dtype).cpu())

    def empty(self, n: int, pinned: bool = True) -> PageBatch:
        """New tensors for ``n`` pages of the pool's layout (pinned where the pool is, unless not ``pinned``)."""
        return {name: torch.empty(n, *t.shape[1:], dtype=t.dtype, pin_memory=self.pin and pinned)
                for name, t in self._fields.items()}

    def gather(self, slots: list[int], out: PageBatch, at: list[int] | None = None) -> None:
        """Copy the pages of ``slots`` into ``out``: in order, or at rows ``at`` of it."""
        index = torch.tensor(slots, dtype=torch.long)
        for name, t in self._fields.items():
            if at is None:
                # The slots are every page, in order: selected straight into the output (one copy).
                torch.index_select(t, 0, index, out=out[name])
            else:
                out[name].index_copy_(0, torch.tensor(at, dtype=torch.long), t.index_select(0, index))

    def copies(self, slots: list[int]) -> list[PageBatch]:
        """Each slot's page as tensors of its own (no page axis), in one gather; not pinned: they go to the store."""
        out = self.empty(len(slots), pinned=False)
        self.gather(slots, out)
        return [{name: t[i] for name, t in out.items()} for i in range(len(slots))]
