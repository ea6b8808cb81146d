"""The checks of ``bench soak``, apart from the run that feeds them, so that each can be tested (and its
rule tightened) on its own.

- ``orphan_keys``: Redis keys under the session namespace that no record names.
- ``missing_groups``: KV groups a record names that are gone or short (its restore would replay).
- ``keys_per_session``: the keys each live session holds (its record and its KV groups).
- ``compare_history``: a session's history as the server reads it back against what its client sent
  and was acknowledged: durable turns lost, turns duplicated, changed or unexpected, token ids rewritten;
  turns acknowledged as not durable may be missing (counted, not a violation).
- ``reconcile``: where a client and the server's history part (after Redis lost writes, or a turn that
  failed half-way stayed in the history): the turns the client keeps, those lost, and the one in doubt
  that turned out to be there.
- ``host_slots``: a replica's used host-tier bytes (slots times the page size) against the sum of the
  sessions it holds, split into live sessions', deleted sessions' and bytes no held session accounts for.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tiers.store.redis.keys import kv_key, session_key, session_of, session_pattern

__all__ = ["session_key", "session_of"]  # the bench names keys as the store and the tier do

# A rule: (redis client, the session's record key, that session's keys found) -> the keys among them
# that no live record owns.
Rule = Callable[[Any, str, list[str]], list[str]]


def record_of(redis, record_key: str) -> dict | None:
    """A live record's data (data present, no tombstone), else None."""
    if redis.type(record_key) not in (b"hash", "hash"):
        return None
    data, deleted = redis.hmget(record_key, "data", "deleted")
    if data is None or deleted is not None:
        return None
    return json.loads(data)


def is_tombstone(redis, record_key: str) -> bool:
    return redis.type(record_key) in (b"hash", "hash") and redis.hget(record_key, "deleted") is not None


def named_keys(redis, namespace: str, sid: str) -> set[str]:
    """The keys a record names: itself and the KV groups its commit named (``app.session_store``)."""
    groups = redis.hget(session_key(namespace, sid), "groups") or b""
    names = groups.decode().split() if isinstance(groups, bytes) else groups.split()
    return {session_key(namespace, sid), *(kv_key(namespace, sid, g) for g in names)}


def named_by_record(namespace: str) -> Rule:
    """The rule: a key is owned when its session's record names it (a live record: itself and its KV
    groups; a tombstone: itself alone)."""

    def rule(redis, record_key: str, keys: list[str]) -> list[str]:
        sid = session_of(namespace, record_key)
        if record_of(redis, record_key) is None:
            return [k for k in keys if not (k == record_key and is_tombstone(redis, record_key))]
        named = named_keys(redis, namespace, sid)
        return [k for k in keys if k not in named]

    return rule


def session_keys(redis, namespace: str, count: int = 1000) -> dict[str, list[str]]:
    """``SCAN`` of the keys under ``namespace``'s session prefix, by session id. On a cluster, run it on
    every primary: each finds its own sessions whole (a session's keys share one slot)."""
    by_session: dict[str, list[str]] = {}
    for raw in redis.scan_iter(match=session_pattern(namespace), count=count):
        key = raw.decode() if isinstance(raw, bytes) else raw
        sid = session_of(namespace, key)
        if sid is not None:
            by_session.setdefault(sid, []).append(key)
    return by_session


def orphan_keys(redis, namespace: str, rule: Rule | None = None, count: int = 1000) -> list[str]:
    """The keys under ``namespace``'s session prefix, sorted, that no record owns by ``rule`` (default
    ``named_by_record``). ``redis`` is a synchronous ``redis.Redis`` client."""
    rule = rule or named_by_record(namespace)
    found: list[str] = []
    for sid, keys in session_keys(redis, namespace, count).items():
        found += rule(redis, session_key(namespace, sid), keys)
    return sorted(found)


def keys_per_session(redis, namespace: str, count: int = 1000) -> dict[str, int]:
    """Keys each session with a live record holds (the record and its KV groups, whatever else is there
    too): what one session costs Redis in keys."""
    return {sid: len(keys) for sid, keys in session_keys(redis, namespace, count).items()
            if record_of(redis, session_key(namespace, sid)) is not None}


def missing_groups(redis, namespace: str, count: int = 1000) -> list[str]:
    """KV groups a live record names that are gone, or hold fewer items than it counts (its ``kv``): a
    restore of it would replay the session (``SCAN`` of the records)."""
    out = []
    for raw in redis.scan_iter(match=f"{namespace}:session:*", count=count):
        key = raw.decode() if isinstance(raw, bytes) else raw
        sid = session_of(namespace, key)
        if sid is None or key != session_key(namespace, sid):
            continue
        data = record_of(redis, key)
        groups = (data or {}).get("kv", {}) or {}
        for group, n in (groups.get("groups") or {}).items():
            if redis.hlen(kv_key(namespace, sid, group)) < n:
                out.append(kv_key(namespace, sid, group))
    return sorted(out)


# --- histories -------------------------------------------------------------------------------
@dataclass
class Acked:
    """One acknowledged turn as its client keeps it: its index in the session (the client's count of turns
    it began), the message sent, the reply acknowledged, the session's token ids read back just after (None
    when that read failed), and what its ``done`` said of the save (``storage``): ``durability`` "none"
    (not saved), "memory", "fsync", "replicated", or "unknown" (answered again from a record, which says
    nothing of it). Only a durable turn must survive a store that loses its last writes."""

    index: int
    content: str
    reply: str
    token_ids: list[int] | None = None
    durability: str = "unknown"
    durable: bool = False
    unfinished: bool = False  # found in the history flagged ``error`` or ``cancelled`` (``unfinished``)
    replica: str | None = None  # where to look when a check fails: who answered, when, after how many tries
    at: float | None = None  # ``time.monotonic()`` of the answer
    attempts: int = 1
    failures: list[str] = field(default_factory=list)  # what each failed attempt got, in order
    usage: tuple[int, int] | None = None  # (prompt tokens, reply tokens) its answer counted: where its reply lies


@dataclass
class HistoryFindings:
    lost: list[int] = field(default_factory=list)  # acknowledged durable turns missing from the history
    lost_not_durable: list[int] = field(default_factory=list)  # ... acknowledged as not durable: allowed
    duplicated: list[int] = field(default_factory=list)  # acknowledged turns there more than once
    changed: list[int] = field(default_factory=list)  # there, with another reply than the one acknowledged
    gaps: list[int] = field(default_factory=list)  # there, though an acknowledged turn before them is not
    unexpected: int = 0  # turns there that no client acknowledged (the one in doubt aside)
    returned: int = 0  # turns its client sent and let go of (not saved, or in doubt), saved back since: allowed
    reordered: bool = False
    tokens_rewritten: bool = False  # the ids read back after a turn are not a prefix of the final ids
    tokens_differ: bool = False  # the final ids are not the ones read back after the last acknowledged turn

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.changed or self.gaps or self.unexpected or self.reordered
                    or self.tokens_rewritten or self.tokens_differ)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v}


def pairs(messages: Iterable[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """(user message, the assistant reply after it or None) of a history, system messages aside."""
    out: list[tuple[str, str | None]] = []
    for m in messages:
        if m.get("role") == "user":
            out.append((m.get("content"), None))
        elif m.get("role") == "assistant" and out and out[-1][1] is None:
            out[-1] = (out[-1][0], m.get("content"))
    return out


def unfinished(messages: Iterable[dict[str, Any]]) -> list[int]:
    """The turns (indices into ``pairs``) whose reply did not finish: the engine flags it ``error`` (the turn
    failed, or was stopped when the host tier filled) or ``cancelled``, and keeps it, with what it had
    generated, in the history; its token ids hold an empty reply in its place."""
    out, turn = [], -1
    for m in messages:
        if m.get("role") == "user":
            turn += 1
        elif m.get("role") == "assistant" and turn >= 0 and (m.get("error") or m.get("cancelled")):
            out.append(turn)
    return out


def _is_prefix(short: list[int], long: list[int]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def compare_history(acked: list[Acked], messages: list[dict[str, Any]], token_ids: list[int],
                    in_doubt: str | None = None, sent: dict[str, str | None] | None = None) -> HistoryFindings:
    """What differs between a session's history read back (``messages``, ``token_ids``) and its
    acknowledged turns. ``in_doubt``: the message of a turn sent but never acknowledged, which may be in
    the history once (or not at all). Turns are told apart by their messages, unique in a session. A
    missing turn acknowledged as not durable is allowed (the store may lose it), but then so are all the
    turns after it: one there after a missing one is a gap. ``sent``: every message the client sent, with
    the reply it was acknowledged (None: never): one it let go of, there once with that reply, was saved
    back by the replica that held it (``reconcile``'s "returned"), not a turn nobody sent."""
    found = HistoryFindings()
    final = pairs(messages)
    contents = [c for c, _ in final]
    position: dict[str, int] = {}
    for turn in acked:
        n = contents.count(turn.content)
        if n == 0:
            (found.lost if turn.durable else found.lost_not_durable).append(turn.index)
            continue
        if found.lost or found.lost_not_durable:
            found.gaps.append(turn.index)
        if n > 1:
            found.duplicated.append(turn.index)
        at = contents.index(turn.content)
        position[turn.content] = at
        if final[at][1] != turn.reply:
            found.changed.append(turn.index)
    known = {t.content for t in acked}
    extra = [c for c in contents if c not in known]
    if in_doubt is not None and extra.count(in_doubt) == 1:
        extra.remove(in_doubt)
    sent, replies = sent or {}, dict(final)
    found.returned = sum(1 for c in extra if c in sent and extra.count(c) == 1 and sent[c] in (None, replies[c]))
    found.unexpected = len(extra) - found.returned
    order = [position[t.content] for t in acked if t.content in position]
    found.reordered = order != sorted(order)
    # Ids read back after a turn that is gone say nothing of the final ids.
    seen = [t.token_ids for t in acked if t.token_ids is not None and t.content in position]
    found.tokens_rewritten = any(not _is_prefix(a, b) for a, b in zip(seen, seen[1:])) or bool(
        seen and not _is_prefix(seen[-1], token_ids))
    exact = [(c, r) for c, r in final] == [(t.content, t.reply) for t in acked]
    if exact and acked and acked[-1].token_ids is not None:
        found.tokens_differ = acked[-1].token_ids != token_ids
    return found


@dataclass
class Reconciled:
    """A client's turns against the server's history after they parted: ``kept`` (the acknowledged turns
    the history begins with), ``lost`` (the acknowledged turns after those: gone), and the history's turns
    after the kept ones (``after``, in order): ``adopted`` (the turn in doubt, last: it ran), ``returned``
    (turns this client sent and let go of, as not saved or in doubt, that a replica holding them saved
    back since: allowed, with the reply acknowledged if there was one) and ``foreign`` (turns the client
    never sent, or with another reply than it was acknowledged: a violation). The client goes on from
    ``turns``, the history as it stands."""

    kept: list[Acked]
    lost: list[Acked]
    adopted: Acked | None = None
    foreign: list[Acked] = field(default_factory=list)
    returned: list[Acked] = field(default_factory=list)
    after: list[Acked] = field(default_factory=list)

    @property
    def turns(self) -> list[Acked]:
        return [*self.kept, *self.after]

    @property
    def lost_durable(self) -> list[Acked]:
        return [t for t in self.lost if t.durable]


def reconcile(acked: list[Acked], messages: list[dict[str, Any]], in_doubt: str | None = None,
              doubt_index: int = -1, sent: dict[str, str | None] | None = None) -> Reconciled:
    """Where ``acked`` and the history read back (``messages``) part. The history is taken as it stands:
    a turn of the client's is kept only where it and every turn before it are there, same message and
    same reply, in the same place; ``in_doubt`` (sent as turn ``doubt_index``, never acknowledged) is
    adopted where it comes right after them, or last; ``sent``: every message the client sent in the
    session, with the reply it was acknowledged (None: never), for the turns it let go of."""
    final = pairs(messages)
    n = 0
    while n < min(len(acked), len(final)) and final[n] == (acked[n].content, acked[n].reply):
        n += 1
    found = Reconciled(acked[:n], acked[n:])
    failed, sent = set(unfinished(messages)), sent or {}
    kept = {t.content for t in found.kept}
    for i, (c, r) in enumerate(final[n:], start=n):
        if c == in_doubt and r is not None and i == len(final) - 1:
            found.adopted = Acked(doubt_index, c, r, unfinished=i in failed)
            found.after.append(found.adopted)
        elif c in sent and c not in kept and r is not None and sent[c] in (None, r):
            found.returned.append(Acked(-1, c, r, durability="returned", unfinished=i in failed))
            found.after.append(found.returned[-1])
        else:
            found.foreign.append(Acked(-1, c, r or "", durability="foreign", unfinished=i in failed))
            found.after.append(found.foreign[-1])
        kept.add(c)
    return found


# --- host tier -------------------------------------------------------------------------------
def host_slots(host_bytes: int, held: dict[str, int], deleted: set[str]) -> dict[str, Any]:
    """One replica's host tier: ``host_bytes`` its used slots' bytes (``/v1/stats``), ``held`` the host
    bytes of each session it holds (``GET /v1/sessions/{id}``), ``deleted`` the sessions clients
    deleted. Used slots must be the live sessions' exactly: a deleted session still holding pages, or
    pages no held session accounts for, are leaks."""
    live = sum(b for sid, b in held.items() if sid not in deleted)
    dead = {sid: b for sid, b in held.items() if sid in deleted}
    return {
        "host_bytes": host_bytes,
        "live_sessions_bytes": live,
        "deleted_sessions_held": len(dead),
        "deleted_sessions_bytes": sum(dead.values()),
        "deleted_examples": sorted(dead)[:10],  # where to look in the replica's log
        "unaccounted_bytes": host_bytes - live - sum(dead.values()),
        "ok": host_bytes == live,
    }
