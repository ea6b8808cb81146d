"""The checks of ``bench soak``, apart from the run that feeds them, so that each can be tested (and its
rule tightened) on its own.

- ``orphan_keys``: Redis keys under the session namespace that no record names.
- ``compare_history``: a session's history as the server reads it back against what its client sent
  and was acknowledged: turns lost, duplicated, changed or unexpected, token ids rewritten.
- ``host_slots``: a replica's used host-tier bytes (slots times the page size) against the sum of the
  sessions it holds, split into live sessions', deleted sessions' and bytes no held session accounts for.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tiers.cold_layer import page_names
from tiers.keys import kv_key, manifest_key, session_key, session_of, session_pattern, writer_key, writing_key
from tiers.redis_tier import decode_tensors
from tiers.session_kv import table_names, valid_ref

__all__ = ["session_key", "session_of"]  # the bench names keys as the store and the tier do

# A rule: (redis client, the session's record key, that session's keys found) -> the keys among them
# that no live record owns.
Rule = Callable[[Any, str, list[str]], list[str]]


def record_of(redis, record_key: str) -> dict | None:
    """A live record's data (version and data present, no tombstone), else None."""
    if redis.type(record_key) not in (b"hash", "hash"):
        return None
    version, data, deleted = redis.hmget(record_key, "version", "data", "deleted")
    if version is None or data is None or deleted is not None:
        return None
    return json.loads(data)


def is_tombstone(redis, record_key: str) -> bool:
    return redis.type(record_key) in (b"hash", "hash") and redis.hget(record_key, "deleted") is not None


def named_keys(redis, namespace: str, sid: str, kv: dict | None) -> set[str]:
    """The keys a record names: itself, its manifest, and its KV generation's tables and the pages
    they list (``tiers.session_kv``)."""
    named = {session_key(namespace, sid), manifest_key(namespace, sid)}
    parsed = valid_ref(kv) if isinstance(kv, dict) else None
    if parsed is None:
        return named
    gen, layers = parsed
    names = set(table_names(gen, layers))
    for layer in range(layers):
        header, data = redis.hmget(kv_key(namespace, sid, f"{gen}.index-l{layer}"), "header", "data")
        if header is not None:
            names |= set(page_names(layer, decode_tensors(header, data)[0]))
    return named | {kv_key(namespace, sid, n) for n in names}


def named_by_record(namespace: str) -> Rule:
    """The rule: a key is owned when its session's record names it (a live record: itself, its
    manifest, its generation's tables and pages; a tombstone: itself alone)."""

    def rule(redis, record_key: str, keys: list[str]) -> list[str]:
        sid = session_of(namespace, record_key)
        data = record_of(redis, record_key)
        if data is None:
            return [k for k in keys if not (k == record_key and is_tombstone(redis, record_key))]
        named = named_keys(redis, namespace, sid, data.get("kv"))
        return [k for k in keys if k not in named]

    return rule


def orphan_keys(redis, namespace: str, rule: Rule | None = None, count: int = 1000) -> list[str]:
    """``SCAN`` the keys under ``namespace``'s session prefix and return, sorted, those no record owns
    by ``rule`` (default ``named_by_record``). ``redis`` is a synchronous ``redis.Redis`` client."""
    rule = rule or named_by_record(namespace)
    by_session: dict[str, list[str]] = {}
    for raw in redis.scan_iter(match=session_pattern(namespace), count=count):
        key = raw.decode() if isinstance(raw, bytes) else raw
        sid = session_of(namespace, key)
        if sid is not None:
            by_session.setdefault(sid, []).append(key)
    found: list[str] = []
    for sid, keys in by_session.items():
        found += rule(redis, session_key(namespace, sid), keys)
    return sorted(found)


def dead_writers(redis, namespace: str) -> int:
    """Entries of the KV writers' log whose writer no longer lives (what it left is still to sweep)."""
    entries = [m.decode() if isinstance(m, bytes) else m for m in redis.zrange(writing_key(namespace), 0, -1)]
    writers = {e.split("|", 1)[0] for e in entries}
    dead = {w for w in writers if not redis.exists(writer_key(namespace, w))}
    return sum(1 for e in entries if e.split("|", 1)[0] in dead)


# --- histories -------------------------------------------------------------------------------
@dataclass
class Acked:
    """One acknowledged turn as its client keeps it: its index in the session, the message sent, the
    reply acknowledged, and the session's token ids read back just after (None when that read failed)."""

    index: int
    content: str
    reply: str
    token_ids: list[int] | None = None


@dataclass
class HistoryFindings:
    lost: list[int] = field(default_factory=list)  # acknowledged turns missing from the history
    duplicated: list[int] = field(default_factory=list)  # acknowledged turns there more than once
    changed: list[int] = field(default_factory=list)  # there, with another reply than the one acknowledged
    unexpected: int = 0  # turns there that no client acknowledged (the one in doubt aside)
    reordered: bool = False
    tokens_rewritten: bool = False  # the ids read back after a turn are not a prefix of the final ids
    tokens_differ: bool = False  # the final ids are not the ones read back after the last acknowledged turn

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.changed or self.unexpected or self.reordered
                    or self.tokens_rewritten or self.tokens_differ)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if v}
        return out


def pairs(messages: Iterable[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """(user message, the assistant reply after it or None) of a history, system messages aside."""
    out: list[tuple[str, str | None]] = []
    for m in messages:
        if m.get("role") == "user":
            out.append((m.get("content"), None))
        elif m.get("role") == "assistant" and out and out[-1][1] is None:
            out[-1] = (out[-1][0], m.get("content"))
    return out


def _is_prefix(short: list[int], long: list[int]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def compare_history(acked: list[Acked], messages: list[dict[str, Any]], token_ids: list[int],
                    in_doubt: str | None = None) -> HistoryFindings:
    """What differs between a session's history read back (``messages``, ``token_ids``) and its
    acknowledged turns. ``in_doubt``: the message of a turn sent but never acknowledged, which may be in
    the history once (or not at all). Turns are told apart by their messages, unique in a session."""
    found = HistoryFindings()
    final = pairs(messages)
    contents = [c for c, _ in final]
    position: dict[str, int] = {}
    for turn in acked:
        n = contents.count(turn.content)
        if n == 0:
            found.lost.append(turn.index)
            continue
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
    found.unexpected = len(extra)
    order = [position[t.content] for t in acked if t.content in position]
    found.reordered = order != sorted(order)
    seen = [t.token_ids for t in acked if t.token_ids is not None]
    found.tokens_rewritten = any(not _is_prefix(a, b) for a, b in zip(seen, seen[1:])) or bool(
        seen and not _is_prefix(seen[-1], token_ids))
    exact = [(c, r) for c, r in final] == [(t.content, t.reply) for t in acked]
    if exact and acked and acked[-1].token_ids is not None:
        found.tokens_differ = acked[-1].token_ids != token_ids
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
        "unaccounted_bytes": host_bytes - live - sum(dead.values()),
        "ok": host_bytes == live,
    }
