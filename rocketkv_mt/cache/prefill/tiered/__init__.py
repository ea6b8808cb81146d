"""The ``tiered`` prefill policy, ``ReselectTiered``: the device holds only the primary set, the rest
of the history is cold, and every turn re-selects over both. Split by job, one module each:

- ``policy``: the policy the cache calls (turn hooks, split attention, settling, persistence);
- ``reads``: which cold pages a turn reads, and reading the next layer's ahead on the page reader;
- ``choice``: Stage 1's choice over the device and the pages read back;
- ``apply``: applying a choice, whole or not at all;
- ``pending``: a layer's re-selection between its attention and its settling;
- ``bounds``: what a turn may hold on the device and write cold (the memory model's bounds).

Only ``ReselectTiered`` is for use outside this package (the cache modes register it).
"""
from __future__ import annotations

from rocketkv_mt.cache.prefill.tiered.policy import ReselectTiered

__all__ = ["ReselectTiered"]
