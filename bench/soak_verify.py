"""The checks ``bench soak`` runs once the faults are over, against the live fleet and its Redis (the rules
themselves are ``bench.soak_checks``): histories, deletes, host slots, records naming missing KV, orphan
keys and keys per session. Redis is read on every primary of the topology: on a cluster each holds its
own sessions whole (a session's keys share one slot).
"""
from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import httpx
import redis

from bench.soak_checks import (compare_history, host_slots, keys_per_session, missing_groups, orphan_keys, record_of,
                               session_key, session_of)
from bench.soak_log import SessionLog
from bench.soak_faults import all_saved
from bench.soak_fleet import Fleet
from bench.soak_forced import Transcript, transcript_of

EXAMPLES = 10  # violations listed per check (all are counted)
DURABLE = ("fsync", "replicated")  # a delete written this way must hold


async def quiesce(http: httpx.AsyncClient, fleet: Fleet, timeout: float) -> bool:
    """Every fault undone and every process up; True once every replica is healthy with no unsaved session."""
    await asyncio.to_thread(fleet.revive)
    return await all_saved(http, fleet.urls, timeout)


async def _get(http: httpx.AsyncClient, url: str, **kw) -> httpx.Response | None:
    try:
        return await http.get(url, **kw)
    except httpx.TransportError:
        return None


async def listing(http: httpx.AsyncClient, url: str) -> list[str]:
    r = await _get(http, f"{url}/v1/sessions")
    return [s["session_id"] for s in r.json()["sessions"]] if r is not None and r.status_code == 200 else []


async def held_host_bytes(http, url: str, tokens: dict[str, str]) -> dict[str, int]:
    """Host bytes of each session the replica holds whose token a client has (``GET /v1/sessions/{id}``)."""
    held: dict[str, int] = {}
    for sid in await listing(http, url):
        if sid not in tokens:  # made, but its answer never reached a client: it has no turns
            continue
        r = await _get(http, f"{url}/v1/sessions/{sid}", headers={"x-session-token": tokens[sid]})
        if r is not None and r.status_code == 200:
            held[sid] = r.json()["memory"]["host_bytes"]
    return held


async def host_bytes(http, url: str) -> int | None:
    r = await _get(http, f"{url}/v1/stats")
    return r.json().get("host_bytes") if r is not None and r.status_code == 200 else None


async def check_host(http, fleet: Fleet, logs: list[SessionLog]) -> dict[str, dict[str, Any]]:
    """Per replica: used host bytes against its sessions'. A first pass reads every held session, which
    drops any stale copy (its restore holds no pages); the second measures, with /v1/stats read before
    and after it, until both agree."""
    tokens = {s.sid: s.token for s in logs}
    deleted = {s.sid for s in logs if s.deleted}
    out: dict[str, dict[str, Any]] = {}
    for replica in fleet.replicas:
        await held_host_bytes(http, replica.url, tokens)
        for _ in range(3):
            before = await host_bytes(http, replica.url)
            held = await held_host_bytes(http, replica.url, tokens)
            after = await host_bytes(http, replica.url)
            if before is not None and before == after:
                break
        if after is None:
            out[replica.name] = {"ok": False, "error": "/v1/stats did not answer"}
        else:
            out[replica.name] = host_slots(after, held, deleted)
    return out


async def _export(http, urls: list[str], s: SessionLog) -> httpx.Response | None:
    for url in urls:
        r = await _get(http, f"{url}/v1/sessions/{s.sid}/export", headers={"x-session-token": s.token})
        if r is not None and r.status_code in (200, 404):
            return r
    return None


async def check_histories(http, fleet: Fleet, logs: list[SessionLog]) -> tuple[dict[str, Any], dict[str, list]]:
    """Every surviving session's history against its client's turns (``compare_history``), and the turns
    every client found gone along the way (``reconcile``): a durable one missing is a violation, one
    acknowledged as not durable is counted (here at the end; along the way, by the tally). Also the
    histories read, by session, for the reference run."""
    holders: dict[str, str] = {}
    for url in fleet.urls:
        for sid in await listing(http, url):
            holders.setdefault(sid, url)
    turns, bad, lost_sessions, unreadable, finals = Counter(), [], [], [], {}
    checked = 0
    for s in logs:
        # What its client found gone, or never sent, along the way (deleted sessions too): durable turns lost
        # are violations; the others the tally counts.
        earlier = {"lost_earlier": [t.index for t in s.lost if t.durable]} if any(t.durable for t in s.lost) else {}
        earlier |= {"foreign": s.foreign, "foreign_seen": s.foreign_seen} if s.foreign else {}
        turns["lost"] += len(earlier.get("lost_earlier", []))
        if s.deleted or s.delete_in_doubt:
            if earlier:
                bad.append({"session": s.sid, "deleted": True, **earlier})
            continue
        checked += 1
        turns["acknowledged"] += len(s.turns) + len(s.lost)
        first = holders.get(s.sid, fleet.urls[0])
        answer = await _export(http, [first, *(u for u in fleet.urls if u != first)], s)
        if answer is None:
            unreadable.append(s.sid)
        elif answer.status_code == 404:  # gone: a violation where any turn of it was durable
            durable = [t.index for t in s.turns if t.durable]
            turns["lost"] += len(durable)
            turns["lost_not_durable"] += len(s.turns) - len(durable)
            if durable or earlier:
                lost_sessions.append({"session": s.sid, "durable_turns": durable, **earlier})
        else:
            data = answer.json()
            finals[s.sid] = data["messages"]
            found = compare_history(s.turns, data["messages"], data["token_ids"], s.in_doubt, s.sent)
            for name in ("lost", "lost_not_durable", "duplicated", "changed", "gaps"):
                turns[name] += len(getattr(found, name))
            turns["returned"] += found.returned
            turns["unexpected"] += found.unexpected + s.foreign
            if not found.ok or earlier:
                bad.append({"session": s.sid, "turns_acknowledged": len(s.turns), "gave_up": s.gave_up,
                            **found.as_dict(), **earlier})
    result = {"sessions": checked, "violations": len(bad) + len(lost_sessions) + len(unreadable),
              "turns": dict(turns), "lost_sessions": len(lost_sessions), "unreadable": len(unreadable),
              "examples": bad[:EXAMPLES], "lost_examples": lost_sessions[:EXAMPLES],
              "unreadable_examples": unreadable[:EXAMPLES]}
    return result, finals


async def check_deleted(http, fleet: Fleet, logs: list[SessionLog], primaries) -> dict[str, Any]:
    """No deleted session answers on any replica; one whose delete was not durable (the store may have
    lost its tombstone) and answers is counted apart, not a violation."""
    deleted = [s for s in logs if s.deleted]
    answering: list[dict[str, Any]] = []
    not_durable = 0
    for s in deleted:
        answered = []
        for replica in fleet.replicas:
            r = await _get(http, f"{replica.url}/v1/sessions/{s.sid}", headers={"x-session-token": s.token})
            if r is None or r.status_code != 404:
                answered.append(f"{replica.name}: {r.status_code if r is not None else 'no answer'}")
        if answered and s.delete_durability in DURABLE:
            answering.append({"session": s.sid, "delete": s.delete_durability, "answered": answered})
        elif answered:
            not_durable += 1

    def records() -> int:
        keys = [session_key(fleet.namespace, s.sid) for s in deleted]
        return sum(1 for k in keys if any(_record_on(p, k) for p in primaries))

    return {"sessions": len(deleted), "answering": len(answering), "answering_not_durable": not_durable,
            "records_left": await asyncio.to_thread(records), "examples": answering[:EXAMPLES]}


def _record_on(primary, key: str) -> bool:
    """A live record at ``key`` on this primary (on a cluster, another shard's key is not)."""
    try:
        return record_of(primary, key) is not None
    except redis.exceptions.MovedError:
        return False


async def check_missing_kv(primaries, namespace: str, restore_failed: int) -> dict[str, Any]:
    """Records naming KV groups that are gone or short. Each is a violation unless the replicas' restores
    said so (``caches_kv_restore_failed``: restores that found KV gone and rebuilt it)."""
    groups = [g for p in primaries for g in await asyncio.to_thread(missing_groups, p, namespace)]
    sessions = sorted({session_of(namespace, g) for g in groups})
    return {"groups": len(groups), "sessions": len(sessions), "restores_failed": restore_failed,
            "unaccounted": max(0, len(sessions) - restore_failed), "examples": groups[:EXAMPLES]}


async def check_orphans(primaries, namespace: str) -> dict[str, Any]:
    """Keys of the session namespace no record names (``EXISTS`` first: a key past its TTL that Redis has
    not yet reclaimed is gone to every reader)."""
    def found() -> list[tuple[str, int]]:
        return [(k, p.ttl(k)) for p in primaries for k in orphan_keys(p, namespace) if p.exists(k)]

    keys = await asyncio.to_thread(found)
    sessions = {session_of(namespace, k) for k, _ in keys}
    return {"keys": len(keys), "sessions": len(sessions),
            "examples": [{"key": k, "ttl_s": ttl} for k, ttl in keys[:EXAMPLES]]}


async def key_figures(primaries, namespace: str) -> dict[str, Any]:
    """Keys per live session (its record and KV groups): how many at most and on average."""
    counts: dict[str, int] = {}
    for p in primaries:
        counts.update(await asyncio.to_thread(keys_per_session, p, namespace))
    n = len(counts)
    return {"sessions": n, "max": max(counts.values(), default=0),
            "mean": round(sum(counts.values()) / n, 2) if n else 0.0}


# What the replicas' logs tell that their counters do not: errors, and caches given one prefill of the
# whole history rather than their turns' feeds again (a session restored from a record without KV).
LOG_LINES = {"errors": re.compile(r"^ERROR "), "restored_history_only": re.compile(r"restored session \S+ \(\S+, "
                                                                                      r"[1-9]\d* tokens, history only\)")}


def log_figures(fleet: Fleet) -> dict[str, dict[str, int]]:
    """Per replica, lines of its output by ``LOG_LINES``: where to look when a check fails. Warnings (Redis
    unreachable, a stale copy dropped, a store found behind) are the run's normal."""
    out = {}
    for replica in fleet.replicas:
        try:
            lines = replica.log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        out[replica.name] = {name: sum(1 for line in lines if rule.search(line)) for name, rule in LOG_LINES.items()}
    return out


async def server_transcripts(http, fleet: Fleet, logs: list[SessionLog], sids) -> dict[str, Transcript]:
    """The transcripts (token ids, turn bounds) of these surviving sessions as the replicas hold them, for
    the reference run's teacher-forced check (``bench.soak_forced``)."""
    out: dict[str, Transcript] = {}
    for s in (s for s in logs if s.sid in sids):
        for url in fleet.urls:
            export = await _get(http, f"{url}/v1/sessions/{s.sid}/export", headers={"x-session-token": s.token})
            detail = await _get(http, f"{url}/v1/sessions/{s.sid}", headers={"x-session-token": s.token})
            if export is not None and detail is not None and export.status_code == detail.status_code == 200:
                found = transcript_of(export.json()["token_ids"], detail.json()["turn_stats"])
                if found is not None:
                    out[s.sid] = found
                break
    return out
