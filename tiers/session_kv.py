"""One session's KV in Redis, by generation: the one owner of how it is written, read back, committed
and collected (a deleted session's keys go by its manifest, ``RedisTier.delete_session``). The cache
policies that keep cold pages call ``write`` and ``read``/``adopt``; the engine calls ``committed`` or
``abandoned`` when the session's record has settled.

A persist writes a new generation: first the pages Redis lacks (pages never change, so generations
share them), then the generation's own page tables and primary sets, ``<gen>.index-l<i>`` and
``<gen>.primary-l<i>``. The session's record then names it (``ref``: ``{"gen", "layers"}``) in its
compare-and-set, the one commit point: a record never names bytes written after it, and a restore
reads exactly the generation its record names, all or nothing. A generation whose record did not
commit is removed (``abandoned``); once one commits, the generations before it and the copies of pages
freed since are collected (``committed``). After a move, the new holder's first commit also clears
what earlier holders left: keys in the manifest that nothing here names (what a holder that crashed,
or lost the session, wrote after its last commit). Not before: until that commit, the holder it was
restored from may still be saving, and its save may yet win. (Every first commit in a process sweeps: a
restore's, and that of a session made here, whose manifest holds only its own names.) A restore takes
over the pages it adopts (``RedisTier.own``). A holder that dies with no commit after
it (a replica killed mid-turn on a session no one saves again) leaves its keys to ``sweep_dead_writer``:
once its liveness lapses, another process deletes what it wrote last that the record does not name.

Lifetimes: the record's TTL is renewed by every save; a generation's keys are written with a quarter
TTL more, and the pages it shares with earlier ones are checked and renewed by a save at least a
quarter TTL after they last were (and by every read). So KV outlives the record naming it.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from tiers.base import PageBatch, batch_nbytes
from tiers.cold_layer import page_names
from tiers.host import HostTier
from tiers.keys import table_names, tables_of

__all__ = ["SessionKV", "StoredLayer", "table_names", "valid_ref"]


@dataclass(frozen=True)
class StoredLayer:
    """What a generation keeps of one layer: its cold pages' ids, its page table and its primary set
    (named tensors: keys/values (Hkv, kept, d), positions (Hkv, kept))."""

    pages: list[str]
    index: PageBatch
    primary: PageBatch


class KVNotWritten(RuntimeError):
    """A generation's writes failed (what they wrote was removed): the record goes without KV for now."""


def valid_ref(ref: dict) -> tuple[str, int] | None:
    """A record's generation reference as (gen, layers), or None where it is not one."""
    gen, layers = ref.get("gen"), ref.get("layers")
    if isinstance(gen, str) and gen.isalnum() and isinstance(layers, int) and layers > 0:
        return gen, layers
    return None


class SessionKV:
    def __init__(self, host: HostTier, session_id: str):
        self.host, self.sid, self.redis = host, session_id, host.redis

    @property
    def available(self) -> bool:
        return self.redis is not None

    def write(self, layers: list[StoredLayer]) -> tuple[dict, int] | None:
        """Write a new generation: (its reference, for the record; bytes written), or None when a write
        failed (what it wrote is then removed, as for a record that did not commit)."""
        if self.redis is None:
            return None
        gen = secrets.token_hex(6)
        self.host.hold(self.sid, gen, len(layers), [pid for layer in layers for pid in layer.pages])
        # Pages believed in Redis were written or checked within a quarter TTL, so their keys outlive the
        # record by then; checking them all (an EXPIRE each: ~0.1 s for 20k pages) is kept for when that
        # quarter has passed. A spill, which drops a host copy, always checks.
        verify = self.host.due_renewal(self.sid, self.redis.ttl_s / 4)
        written = 0
        for layer in layers:
            n = self.host.persist_many(self.sid, layer.pages, verify)
            if n is None:
                self.abandoned({"gen": gen, "layers": len(layers)})
                return None
            written += n
        tables = dict(zip(table_names(gen, len(layers)), (t for layer in layers for t in (layer.index, layer.primary))))
        if not self.redis.put_pages(self.sid, tables):
            self.abandoned({"gen": gen, "layers": len(layers)})
            return None
        if verify:
            self.host.renewed(self.sid)
        return {"gen": gen, "layers": len(layers)}, written + sum(batch_nbytes(t) for t in tables.values())

    def read(self, ref: dict) -> list[tuple[PageBatch, PageBatch]] | None:
        """The page table and primary set of each layer of the generation ``ref`` names; None when the
        reference is malformed or any of them is missing."""
        parsed = valid_ref(ref) if self.redis is not None else None
        if parsed is None:
            return None
        got = self.redis.get_pages(self.sid, table_names(*parsed))
        if any(t is None for t in got):
            return None
        return [(got[i], got[i + 1]) for i in range(0, len(got), 2)]

    def adopt(self, ref: dict, pages: list[str]) -> bool:
        """Whether Redis holds every page the generation names (their TTLs renewed on the way); if so the
        host tier takes them as this session's, named by that generation."""
        parsed = valid_ref(ref)
        found = self.redis.renew_pages(self.sid, pages) if parsed is not None and self.redis is not None else None
        if found is None or not all(found) or not self.redis.own(self.sid, pages):
            return False
        self.host.adopt(self.sid, parsed[0], parsed[1], pages)
        return True

    def committed(self, ref: dict | None) -> None:
        """The record naming ``ref`` committed: remove the generations before it and the page copies
        nothing names now. ``None``: a record naming no KV committed, superseding every generation."""
        parsed = valid_ref(ref) if ref is not None else (None, 0)
        if parsed is None or self.redis is None:
            return
        done = self.host.commit(self.sid, parsed[0])
        names = done.names()
        if done.sweep:
            names = list(dict.fromkeys(names + self._strays()))  # a collected generation's tables are strays too
        self.redis.delete_pages(self.sid, names)

    def abandoned(self, ref: dict) -> None:
        """The record naming ``ref`` was not committed: its generation goes, and the page copies that
        only it named."""
        parsed = valid_ref(ref)
        if parsed is None or self.redis is None:
            return
        done = self.host.abandon(self.sid, parsed[0])
        self.redis.delete_pages(self.sid, [*table_names(*parsed), *done.pages])

    def names(self, ref: dict | None) -> set[str] | None:
        """Every KV name the generation ``ref`` names (its tables and the pages they list); the empty set
        for a record with no KV; None when its tables cannot be read (Redis failing, or one is gone)."""
        parsed = valid_ref(ref) if isinstance(ref, dict) else None
        if parsed is None:
            return set()
        tables = self.read(ref)
        if tables is None:
            return None
        return set(table_names(*parsed)).union(*(page_names(layer, index) for layer, (index, _) in enumerate(tables)))

    def sweep_dead_writer(self, writer: str, ref: dict | None) -> int | None:
        """Delete what ``writer``, which no longer lives, wrote last of the session and its record (naming
        ``ref``; None: no live record) does not name; the names deleted, or None when not done this time."""
        named = self.names(ref)
        return None if named is None or self.redis is None else self.redis.sweep_writer(self.sid, writer, named)

    def _strays(self) -> list[str]:
        """Names in the manifest that nothing here needs: what an earlier holder wrote after its last
        commit, or freed without committing again (it crashed, or lost the session to this process)."""
        names = self.redis.manifest(self.sid)
        if names is None:
            return []
        pages, gens = self.host.kept(self.sid)
        keep = pages | set(tables_of(gens))
        return sorted(names - keep)

