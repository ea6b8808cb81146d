"""Which of a process's cold pages have a copy in Redis, which KV generations name them, and which copies
wait to be deleted: the bookkeeping behind "a record names exactly one generation".

A generation (``tiers.session_kv``) is the set of pages, page tables and primary set one persist
wrote; the session's record names one. A page's copy must outlive the page's free for as long as a
generation this process knows names it: the committed one (a restore anywhere reads it) or one
written and still waiting for its record's compare-and-set. So a freed page whose copy a generation
names waits; it is deleted once a later generation commits without it (or the one naming it is
abandoned). Any other copy of a freed page may go at once.

Pure bookkeeping, not thread-safe: its one user, the host tier, calls it under its lock and makes the
Redis calls these answers ask for with the lock released.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tiers.keys import tables_of


@dataclass
class Generation:
    layers: int
    pages: frozenset[str]


@dataclass
class _Session:
    copies: set[str] = field(default_factory=set)  # pages Redis is believed to hold
    gens: dict[str, Generation] = field(default_factory=dict)  # written or committed, oldest first
    waiting: set[str] = field(default_factory=set)  # freed pages whose copy a generation still names
    # The first commit here also clears what earlier holders left (a replica killed after it wrote, or one
    # whose record named no KV): a session is swept once per process that holds it.
    sweep: bool = True
    committed: str | None = None  # the generation a record was last known here to name
    renewed_at: float | None = None  # when its pages were last all checked and renewed (None: not here)


@dataclass(frozen=True)
class Collected:
    """What a commit or an abandon made unnecessary: generations (id -> layers) and page copies."""

    gens: dict[str, int]
    pages: list[str]
    sweep: bool = False

    def names(self) -> list[str]:
        """The KV names to delete: the generations' tables and primary sets, then the page copies."""
        return [*tables_of(self.gens), *self.pages]


class RedisCopies:
    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}

    def _of(self, sid: str) -> _Session:
        return self._sessions.setdefault(sid, _Session())

    def sessions(self) -> int:
        return len(self._sessions)

    # --- copies ------------------------------------------------------------------------------
    def holds(self, sid: str, pid: str) -> bool:
        s = self._sessions.get(sid)
        return s is not None and pid in s.copies

    def believed(self, sid: str, pids: list[str]) -> list[str]:
        """Those of ``pids`` Redis is believed to hold (a belief a caller checks before it relies on it)."""
        s = self._sessions.get(sid)
        return [] if s is None else [p for p in pids if p in s.copies]

    def add(self, sid: str, pids) -> None:
        self._of(sid).copies.update(pids)

    def lost(self, sid: str, pids) -> None:
        """Copies found missing (expired, or Redis came back empty): no longer believed."""
        s = self._sessions.get(sid)
        if s is not None:
            s.copies.difference_update(pids)

    def free(self, sid: str, pids: list[str]) -> list[str]:
        """Pages freed: their copies no generation names, to delete now (those named wait)."""
        s = self._sessions.get(sid)
        if s is None:
            return []
        named = self._named(s)
        now: list[str] = []
        for pid in pids:
            if pid in s.copies:
                s.copies.discard(pid)
                (s.waiting.add if pid in named else now.append)(pid)
        return now

    def written_after_free(self, sid: str, pids: list[str]) -> list[str]:
        """Copies that a spill wrote of pages freed meanwhile: those no generation names, to delete now
        (the others wait, as ``free`` has them wait)."""
        s = self._sessions.get(sid)
        if s is None:  # the session left or was deleted meanwhile: nothing names them
            return list(pids)
        named = self._named(s)
        s.waiting.update(p for p in pids if p in named)
        return [p for p in pids if p not in named]

    # --- generations -------------------------------------------------------------------------
    def hold(self, sid: str, gen: str, layers: int, pids) -> None:
        """A generation being written names these pages: none of their copies goes until it is settled."""
        self._of(sid).gens[gen] = Generation(layers, frozenset(pids))

    def adopt(self, sid: str, gen: str, layers: int, pids) -> None:
        """A session restored from a record naming ``gen``: its pages are in Redis, and named."""
        s = self._of(sid)
        s.copies.update(pids)
        s.gens[gen] = Generation(layers, frozenset(pids))
        s.committed = gen
        s.sweep = True
        s.renewed_at = time.monotonic()  # the restore's existence check renewed every page it names

    def commit(self, sid: str, gen: str | None) -> Collected:
        """``gen``'s record was committed: the generations written before it, and the waiting copies no
        remaining generation names, are collected. ``None``: a record naming no KV (its persist failed)
        was committed, which supersedes the generation the record named before and those before it (not
        one written since, as a park's)."""
        s = self._sessions.get(sid)
        if s is None or (gen is not None and gen not in s.gens):
            return Collected({}, [])
        order = list(s.gens)
        if gen is not None:
            stop = order.index(gen)
        else:
            stop = order.index(s.committed) + 1 if s.committed in s.gens else 0
        older = {g: s.gens.pop(g).layers for g in order[:stop]}
        sweep, s.sweep = s.sweep, False
        s.committed = gen
        return Collected(older, self._collect(s), sweep)

    def abandon(self, sid: str, gen: str) -> Collected:
        """``gen``'s record was not committed (it lost its compare-and-set, or its write failed)."""
        s = self._sessions.get(sid)
        if s is None or gen not in s.gens:
            return Collected({}, [])
        return Collected({gen: s.gens.pop(gen).layers}, self._collect(s))

    def kept(self, sid: str) -> set[str]:
        """Every page whose copy is needed: believed in Redis, waiting, or named by a generation."""
        s = self._sessions.get(sid)
        return set() if s is None else s.copies | s.waiting | self._named(s)

    def gens(self, sid: str) -> dict[str, int]:
        s = self._sessions.get(sid)
        return {} if s is None else {g: v.layers for g, v in s.gens.items()}

    @staticmethod
    def _named(s: _Session) -> set[str]:
        return set().union(*(g.pages for g in s.gens.values())) if s.gens else set()

    def _collect(self, s: _Session) -> list[str]:
        named = self._named(s)
        gone = [pid for pid in s.waiting if pid not in named]
        s.waiting.difference_update(gone)
        return gone

    # --- lifetimes ---------------------------------------------------------------------------
    def due_renewal(self, sid: str, every_s: float) -> bool:
        """Whether the session's keys last had their TTL renewed more than ``every_s`` ago (here)."""
        s = self._sessions.get(sid)
        return s is not None and (s.renewed_at is None or time.monotonic() - s.renewed_at > every_s)

    def distrust(self, sid: str) -> None:
        """Redis may have lost what it was believed to hold (it came back empty): check it all next time."""
        s = self._sessions.get(sid)
        if s is not None:
            s.renewed_at = None

    def renewed(self, sid: str) -> None:
        s = self._sessions.get(sid)
        if s is not None:
            s.renewed_at = time.monotonic()

    def leave(self, sid: str) -> Collected:
        """The session leaves this process (its record keeps it): only the generation a record was last
        known to name stays; the others (a park's, one whose record never committed) go, with every
        copy it does not name (nothing restores them). Its bookkeeping goes."""
        s = self._sessions.pop(sid, None)
        if s is None:
            return Collected({}, [])
        kept = s.gens.get(s.committed) if s.committed is not None else None
        named = kept.pages if kept is not None else frozenset()
        others = {g: v.layers for g, v in s.gens.items() if g != s.committed}
        return Collected(others, [pid for pid in s.copies | s.waiting | self._named(s) if pid not in named])

    def forget(self, sid: str) -> None:
        """The session is deleted: its keys go by its manifest, its bookkeeping here."""
        self._sessions.pop(sid, None)
