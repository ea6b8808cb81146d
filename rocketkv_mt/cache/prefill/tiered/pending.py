"""A layer's re-selection between its prefill's attention and its settling: the states it passes
through (``Pending``, ``Choosing``, ``Settling``), the device bytes each holds meanwhile, and whether
it is ``ready`` (``chosen`` would not wait).

Owned by ``ReselectTiered`` (``policy``), which makes one per layer as it attends and settles it; the
page reader only runs the jobs a ``Choosing`` or ``Settling`` waits for. ``chosen`` hands over what is
left to apply (None: nothing), ``end`` lets a job still running finish with its result dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocketkv_mt.cache.prefill.tiered.reads import read_bytes


@dataclass
class Pending:
    """A layer's re-selection, chosen but not applied: ``slots`` (Hkv, kept) into [device slots,
    ``cand``'s slots], their positions and Stage-1 scores, and ``cand`` (keys, values (Hkv, M, d),
    positions, alive, cold slots (Hkv, M)): only the read-back tokens the selection promotes."""

    slots: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    cand: tuple

    def nbytes(self) -> int:
        return read_bytes(self.cand)

    def chosen(self) -> "Pending":
        return self

    def ready(self) -> bool:
        return True

    def end(self) -> None:
        """Let work on the page reader end, its result dropped (nothing runs for a chosen selection)."""


@dataclass
class Choosing:
    """A layer's re-selection still being chosen on the page reader (the model thread goes on with the
    next layer meanwhile): ``future`` gives the ``Pending``; ``cand``, every page the layer read, is
    held until then."""

    future: object  # concurrent.futures.Future of a Pending
    cand: tuple
    transfers: object  # the Transfers that runs it
    # The job and so every tensor it reads, kept until ``chosen``: on CUDA its kernels run on the side
    # stream after the job returns, and what the model thread frees meanwhile could be reused under them.
    job: object

    def nbytes(self) -> int:
        return read_bytes(self.cand)

    def chosen(self) -> Pending:
        return self.transfers.wait(self.future)

    def ready(self) -> bool:
        return self.future.done()

    def end(self) -> None:
        self.transfers.forget(self.future)


@dataclass
class Settling:
    """A layer's re-selection being applied (and, for a layer read whole, chosen) on the page reader
    (promote, demote, the decode set) while the model thread goes on, with the next layer (which waits
    for it before reading its own pages) or with other sessions' steps between the slices of a turn
    fed layer by layer (whose next layer waits for it before taking the turn's keys): ``chosen`` hands
    over nothing left to apply. ``cand``, the pages read that the job holds, is held until then."""

    future: object  # concurrent.futures.Future of the application
    cand: tuple
    transfers: object

    def nbytes(self) -> int:
        return read_bytes(self.cand)

    def chosen(self) -> None:
        self.transfers.wait(self.future)
        return None

    def ready(self) -> bool:
        return self.future.done()

    def end(self) -> None:
        self.transfers.forget(self.future)
