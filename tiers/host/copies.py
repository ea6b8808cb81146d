"""Which of a process's cold pages have a copy in the store, and which of their groups (``tiers.store
.protocol``) a committed record names. A *committed* group lives as long as its record, and the commit
that stops naming it deletes it: a freed page of it needs nothing from here. Any other group this
process wrote is *pending*: renewed here while held, a page of it deleted once freed. A generation being
written waits for its record's compare-and-set. After the store may have lost data (``distrust``), the
next persist checks every belief "the store holds this page" before relying on it. Pure bookkeeping, not
thread-safe: the host tier calls it under its lock, and makes the store calls it asks for unlocked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tiers.store.protocol import group_of


@dataclass
class _Session:
    held: set[str] = field(default_factory=set)  # pages the store is believed to hold
    committed: set[str] = field(default_factory=set)  # groups the last committed record names
    pending: set[str] = field(default_factory=set)  # groups written here that no committed record names
    writing: dict[str, set[str]] = field(default_factory=dict)  # generation -> the groups it names
    tables: set[str] = field(default_factory=set)  # generations' own groups (their page tables) known here
    distrusted: bool = False  # the store may have lost what it was believed to hold


class StoreCopies:
    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}

    def _of(self, sid: str) -> _Session:
        return self._sessions.setdefault(sid, _Session())

    def sessions(self) -> int:
        return len(self._sessions)

    # --- copies ------------------------------------------------------------------------------
    def holds(self, sid: str, pid: str) -> bool:
        s = self._sessions.get(sid)
        return s is not None and pid in s.held

    def believed(self, sid: str, pids: list[str]) -> list[str]:
        s = self._sessions.get(sid)
        return [] if s is None else [p for p in pids if p in s.held]

    def add(self, sid: str, pids) -> None:
        """The store took these pages: believed held, their groups pending unless a record names them."""
        s = self._of(sid)
        s.held.update(pids)
        s.pending.update(g for g in {group_of(p) for p in pids} if g not in s.committed)

    def lost(self, sid: str, pids) -> None:
        s = self._sessions.get(sid)
        if s is not None:
            s.held.difference_update(pids)

    def free(self, sid: str, pids: list[str]) -> list[str]:
        """Pages freed: the copies to delete now (those in groups no committed record names)."""
        s = self._sessions.get(sid)
        if s is None:
            return []
        gone = [p for p in pids if p in s.held]
        s.held.difference_update(gone)
        kept = s.committed | _named(s)
        return [p for p in gone if group_of(p) not in kept]

    def written_after_free(self, sid: str, pids: list[str]) -> list[str]:
        """Copies a spill wrote of pages freed meanwhile: those to delete now, as ``free`` has them."""
        s = self._sessions.get(sid)
        return list(pids) if s is None else [p for p in pids if group_of(p) not in s.committed | _named(s)]

    def pending(self, sid: str) -> list[str]:
        """The groups to renew while this process holds the session (generations in writing included)."""
        s = self._sessions.get(sid)
        return [] if s is None else sorted((s.pending | _named(s)) - s.committed)

    def holding(self) -> list[str]:
        return list(self._sessions)

    # --- generations -------------------------------------------------------------------------
    def write(self, sid: str, gen: str, groups) -> None:
        """A generation naming ``groups`` (its own table group among them) is being written."""
        s = self._of(sid)
        s.writing[gen] = set(groups)
        s.tables.add(gen)
        s.pending.update(g for g in groups if g not in s.committed)

    def commit(self, sid: str, gen: str | None) -> list[str]:
        """The record naming ``gen`` committed: its groups are the committed ones (the commit deleted those
        the record before named and it does not). None: a record without KV committed; the groups the one
        before named are pending again (the commit left them the short TTL) while the cache may need them.
        Returns the pending generations' tables no record can name any more, to delete: a cache needs a
        generation's pages, never an older generation's tables."""
        s = self._sessions.get(sid)
        if s is None:
            return []
        if gen is None:
            s.pending |= s.committed
            s.committed = set()
            return []
        if gen not in s.writing:
            return []  # one committed before (a dropped cache's record named it again): nothing changes
        groups = s.writing.pop(gen)
        s.committed = groups
        s.pending.difference_update(groups)
        s.held = {p for p in s.held if group_of(p) in groups or group_of(p) in s.pending}
        stale = sorted((s.tables & s.pending) - set(s.writing))
        s.pending.difference_update(stale)
        s.tables = (s.tables - set(stale)) & (s.committed | set(s.writing))
        return stale

    def abandon(self, sid: str, gen: str) -> str | None:
        """``gen``'s record did not commit: its tables' group, to delete (its pages, still cached, stay pending)."""
        s = self._sessions.get(sid)
        if s is None or s.writing.pop(gen, None) is None:
            return None
        s.pending.discard(gen)
        s.tables.discard(gen)
        return gen

    def adopt(self, sid: str, gen: str, groups, pids) -> None:
        """A cache restored from generation ``gen`` (these groups and pages): the store holds them. One this
        process wrote and no record named yet (a parked cache's) stays pending; any other was committed."""
        s = self._of(sid)
        s.held.update(pids)
        s.tables.add(gen)
        if gen not in s.writing:
            s.committed = set(groups)
            s.pending.difference_update(s.committed)

    def committed(self, sid: str) -> set[str]:
        s = self._sessions.get(sid)
        return set() if s is None else set(s.committed)

    # --- trust -------------------------------------------------------------------------------
    def distrust(self, sid: str, distrusted: bool = True) -> None:
        """The store may have lost what it was believed to hold of the session (False: checked since)."""
        if (s := self._sessions.get(sid)) is not None:
            s.distrusted = distrusted

    def distrusted(self, sid: str) -> bool:
        s = self._sessions.get(sid)
        return s is not None and s.distrusted

    # --- leaving -----------------------------------------------------------------------------
    def leave(self, sid: str, deleted: bool = False) -> list[str]:
        """The session leaves this process (its record keeps it, or it was ``deleted``): the groups only this
        process could renew or name, to delete now. Unless deleted, a generation still being written (a
        commit whose reply was lost) may be named by a record another replica built on: left to its TTL."""
        s = self._sessions.pop(sid, None)
        if s is None:
            return []
        return sorted((s.pending | _named(s)) - s.committed if deleted else s.pending - s.committed - _named(s))


def _named(s: _Session) -> set[str]:
    """The groups the generations being written name: a record may name them at any moment."""
    return {g for groups in s.writing.values() for g in groups}
