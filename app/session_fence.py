"""Whose state a stored record is, judged by a copy of the session that holds a tag it last committed or
loaded: pure logic over tags (``app.session_store``), nothing that talks to Redis.

A tag is drawn at random by every save, so a store that lost writes can never show a copy its own tag
again: any other tag is "not mine", and the lineages (the tags of each side's last saves) tell which way:

- ``MINE``: the record is the copy's own last save.
- ``MOVED_ON``: the record descends from the copy's state (its lineage holds the copy's tag): another
  replica saved since. The copy is stale: it must not serve again, and the session is restored.
- ``BEHIND``: the record is an ancestor of the copy's state (the copy's lineage holds the stored tag):
  the store lost the copy's later saves, and nobody went on from the older state. The copy is the only
  holder of the truth: it saves it back, by compare-and-set on the stored tag.
- ``DIVERGED``: both went on from a common ancestor: the store lost saves of this copy and another
  replica acknowledged turns on the older state since. The copy must stop serving; the loss is reported.
- ``MISSING``: no record (expired, or the store came back empty): the copy saves it back as new.
- ``DELETED``: a tombstone.
- A record sharing no tag with the copy is taken as moved on, beyond what the lineages reach.
"""
from __future__ import annotations

from app.session_store import DELETED, Stored

__all__ = ["BEHIND", "DELETED", "DIVERGED", "MINE", "MISSING", "MOVED_ON", "judge", "lost_saves"]
MINE, MOVED_ON, BEHIND, DIVERGED, MISSING = "mine", "moved_on", "behind", "diverged", "missing"


def judge(tag: str | None, lineage: list[str], stored: Stored) -> str:
    """How the copy holding ``tag`` (its lineage ``lineage``, ``tag`` last; None: never saved) stands
    against the ``stored`` record."""
    if stored.deleted:
        return DELETED
    if stored.tag is None:
        return MISSING if tag is not None else MINE  # a copy never saved meets no record: the normal case
    if stored.tag == tag:
        return MINE
    if tag is not None and tag in stored.lineage:
        return MOVED_ON
    if stored.tag in lineage:
        return BEHIND
    if set(lineage) & set(stored.lineage):
        return DIVERGED
    return MOVED_ON


def lost_saves(lineage: list[str], stored: Stored) -> int:
    """How many of the copy's saves the store lost: those after the last tag both lineages hold."""
    common = [i for i, t in enumerate(lineage) if t in stored.lineage or t == stored.tag]
    return len(lineage) - 1 - common[-1] if common else len(lineage)
