"""One session's KV in the store, by generation: how it is written, read back and settled (the cache
calls ``write``, ``read`` and ``adopt``; the engine ``committed`` or ``abandoned`` once the record settled).

A persist writes a new generation in one round trip: the pages the store lacks (pages never change, so
generations share them) and its own page tables and primary sets, group ``g<gen>``. The session's record
names it (``ref``: gen, layers, each group with its item count) in its commit, the one commit point
(``app.session_store``): a record never names bytes written after it, and a restore reads exactly the
generation its record names, all or nothing. A generation whose record did not commit loses its tables;
its pages stay pending, renewed while this process holds the cache that needs them.
"""
from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass

from tiers.base import PageBatch, batch_nbytes
from tiers.host.tier import HostTier
from tiers.store.protocol import group_of


@dataclass(frozen=True)
class StoredLayer:
    """What a generation keeps of one layer: its cold pages' ids, its page table and its primary set
    (named tensors: keys/values (Hkv, kept, d), positions (Hkv, kept))."""

    pages: list[str]
    index: PageBatch
    primary: PageBatch


class KVNotWritten(RuntimeError):
    """A generation's writes failed (what they wrote was removed): the record goes without KV for now."""


def table_names(gen: str, layers: int) -> list[str]:
    """The items of a generation's group: each layer's page table and primary set."""
    return [f"g{gen}/{part}{i}" for i in range(layers) for part in ("index", "primary")]


def valid_ref(ref: dict) -> tuple[str, int, dict[str, int]] | None:
    """A record's generation reference as (gen, layers, groups), or None where it is not one."""
    gen, layers, groups = ref.get("gen"), ref.get("layers"), ref.get("groups")
    if (isinstance(gen, str) and gen.isalnum() and isinstance(layers, int) and layers > 0 and isinstance(groups, dict)
            and all(isinstance(g, str) and isinstance(n, int) and n > 0 for g, n in groups.items())):
        return gen, layers, groups
    return None


class SessionKV:
    def __init__(self, host: HostTier, session_id: str):
        self.host, self.sid, self.store = host, session_id, host.store

    available = property(lambda self: self.store is not None)

    def write(self, layers: list[StoredLayer]) -> tuple[dict, int] | None:
        """Write a new generation: (its reference, for the record; bytes written), or None when a write
        failed (what it wrote is then removed, as for a record that did not commit)."""
        if self.store is None:
            return None
        gen = secrets.token_hex(6)
        pages = [pid for layer in layers for pid in layer.pages]
        groups = {**Counter(group_of(pid) for pid in pages), f"g{gen}": 2 * len(layers)}
        table_bytes = sum(batch_nbytes(t) for layer in layers for t in (layer.index, layer.primary))
        # ``bytes``: what the generation names in all, pages shared with earlier ones included (a quota's measure).
        ref = {"gen": gen, "layers": len(layers), "groups": groups, "bytes": len(pages) * self.host.page_bytes + table_bytes}
        self.host.locked(self.host.copies.write, self.sid, f"g{gen}", groups)
        missing = self.host.unstored(self.sid, pages)
        tables = dict(zip(table_names(gen, len(layers)), (t for layer in layers for t in (layer.index, layer.primary))))
        if missing is None or not self.store.put(self.sid, {**missing, **tables}):
            self.abandoned(ref)
            return None
        self.host.stored(self.sid, missing)
        return ref, sum(batch_nbytes(t) for t in [*missing.values(), *tables.values()])

    def read(self, ref: dict) -> list[tuple[PageBatch, PageBatch]] | None:
        """Each layer's page table and primary set in ``ref``'s generation; None if it is malformed or one is gone."""
        parsed = valid_ref(ref) if self.store is not None else None
        if parsed is None:
            return None
        got = self.store.get(self.sid, table_names(parsed[0], parsed[1]))
        if any(t is None for t in got):
            return None
        return [(got[i], got[i + 1]) for i in range(0, len(got), 2)]

    def adopt(self, ref: dict, pages: list[str]) -> bool:
        """Whether the store holds every group the generation names, whole (one round trip); if so the
        host tier takes its pages as this session's."""
        parsed = valid_ref(ref)
        if parsed is None or self.store is None:
            return False
        groups = parsed[2]
        if Counter(group_of(pid) for pid in pages) != {g: n for g, n in groups.items() if g != f"g{parsed[0]}"}:
            return False  # the tables list other pages than the reference counts
        sizes = self.store.sizes(self.sid, list(groups))
        if sizes is None or any(have < groups[g] for g, have in zip(groups, sizes)):
            return False
        self.host.locked(self.host.copies.adopt, self.sid, f"g{parsed[0]}", groups, pages)
        return True

    def committed(self, ref: dict | None) -> None:
        """The record naming ``ref`` committed (None: a record naming no KV)."""
        parsed = valid_ref(ref) if ref is not None else None
        if ref is None or parsed is not None:
            stale = self.host.locked(self.host.copies.commit, self.sid, None if parsed is None else f"g{parsed[0]}")
            if stale and self.store is not None:
                self.store.delete(self.sid, stale)

    def abandoned(self, ref: dict) -> None:
        """The record naming ``ref`` was not committed: its generation's tables go."""
        parsed = valid_ref(ref)
        gone = self.host.locked(self.host.copies.abandon, self.sid, f"g{parsed[0]}") if parsed is not None else None
        if gone is not None and self.store is not None:
            self.store.delete(self.sid, [gone])
