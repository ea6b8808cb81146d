"""``rocketkv-mt bench soak``: sessions, deletes, replica kills and a Redis restart for a while, then
checks that nothing acknowledged was lost and nothing deleted or freed was left behind (issue 40).

A private ``redis-server`` (AOF on, its own port and folder) and ``--replicas`` chat replicas, each
``rocketkv-mt serve --no-ray`` in a process of its own (mode ``tiered``, a small token budget and host
tier, a few tokens a reply, one thread: quick on a small CPU). ``--sessions`` clients
(``bench.soak_client``) talk to them through the REST API for ``--duration`` seconds: each opens a
session, takes a random number of short turns and deletes it, then opens the next. Meanwhile every
``--restart-every`` seconds one replica is killed (SIGKILL) and started again, and once (at
``--redis-restart-at`` of the run) Redis is shut down and started again on its AOF; one fault at a
time, each after the replicas saved what Redis missed (``--kill-unsaved``: not waiting for that).

Then, with every process up, every replica's unsaved sessions saved and what killed replicas' KV
writers left swept (their liveness lapses, then a live replica sweeps) (``bench.soak_checks``):

- histories: every surviving session's messages and token ids, read back through
  ``GET /v1/sessions/{id}/export``, are what its client was acknowledged: no turn lost, duplicated or
  changed, no token id rewritten;
- deletes: no deleted session answers ``GET /v1/sessions/{id}`` on any replica (404 everywhere);
- Redis: ``SCAN`` finds no key under the session namespace whose session has no live record;
- host tier: each replica's used host bytes (``/v1/stats`` ``host_bytes``) are its live sessions' sum
  (``memory.host_bytes`` of each session it holds).

Every violation is counted and listed; the command exits 1 when there is any.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from app.progress import progress
from bench.common import write_json
from bench.soak_checks import (compare_history, dead_writers, host_slots, orphan_keys, record_of, session_key,
                               session_of)
from bench.soak_client import Client, Options, SessionLog, Tally
from bench.soak_procs import Cluster

EXAMPLES = 10  # violations listed per check (all are counted)
QUIESCE_S = 60.0  # how long the replicas get to save what Redis missed


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_n, hi_n = int(lo), int(hi or lo)
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"a range of turns is MIN-MAX with 1 <= MIN <= MAX, not {text!r}")
    return lo_n, hi_n


def replica_env(args) -> dict[str, str]:
    env = {
        "RKV_MODE": args.mode,
        "RKV_TOKEN_BUDGET": str(args.budget),
        "RKV_MAX_NEW_TOKENS": str(args.max_tokens),
        "RKV_HOST_TIER_BYTES": str(args.host_tier_mib * 1024 * 1024),
        "RKV_THREADS": os.environ.get("RKV_THREADS", "1"),
    }
    if args.model:
        env["RKV_MODEL"] = args.model
    return env


def fault_plan(args) -> list[tuple[float, str, int]]:
    """(seconds into the run, "replica" or "redis", which replica) in order: a replica restart every
    ``restart_every`` seconds, the replicas in turn, and one Redis restart."""
    plan: list[tuple[float, str, int]] = []
    if args.restart_every > 0:
        k = 1
        while args.restart_every * k < args.duration:
            plan.append((args.restart_every * k, "replica", (k - 1) % args.replicas))
            k += 1
    if 0 < args.redis_restart_at < 1:
        plan.append((args.redis_restart_at * args.duration, "redis", -1))
    return sorted(plan)


async def unsaved(http: httpx.AsyncClient, url: str) -> int | None:
    """Sessions the replica holds that Redis lacks (``/healthz``); None while it or its Redis is not ok."""
    try:
        health = (await http.get(f"{url}/healthz")).json()
    except (httpx.HTTPError, ValueError):
        return None
    return int(health.get("unsaved_sessions") or 0) if health.get("status") == "ok" else None


async def all_saved(http: httpx.AsyncClient, cluster: Cluster, timeout: float) -> bool:
    """Wait until every replica is healthy with nothing unsaved; False if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        if all(n == 0 for n in [await unsaved(http, url) for url in cluster.urls]):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)


class Faults:
    """Runs the plan, one fault after another, until it ends or ``stop`` is set (a fault under way
    finishes first: its process comes back). Each waits ``settle_s`` after the one before and, unless
    ``kill_unsaved``, until every replica has saved what Redis missed (at most ``settle_max_s``): a turn
    acknowledged while Redis was down lives in one replica's memory until then, and killing that replica
    loses it by design. Each kill says how many sessions its replica had not saved."""

    def __init__(self, cluster: Cluster, plan, args, http: httpx.AsyncClient, say):
        self.cluster, self.plan, self.args, self.http, self.say = cluster, plan, args, http, say
        self.stop = asyncio.Event()
        self.restarts = Counter()
        self.events: list[dict[str, Any]] = []

    def _log(self, t0: float, event: str) -> None:
        self.events.append({"t": round(time.monotonic() - t0, 1), "event": event})
        self.say(f"soak: {self.events[-1]['t']:.0f} s: {event}")

    async def run(self, t0: float) -> None:
        ready = t0
        for at, what, which in self.plan:
            start = max(t0 + at, ready)  # never two at once
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, start - time.monotonic()))
            if self.stop.is_set():
                return
            if not self.args.kill_unsaved:
                waited = time.monotonic()
                saved = await all_saved(self.http, self.cluster, self.args.settle_max_s)
                if not saved or time.monotonic() - waited > 1:
                    self._log(t0, f"waited {time.monotonic() - waited:.0f} s for the replicas to save"
                              + ("" if saved else " (gave up)"))
                if self.stop.is_set():
                    return
            try:
                if what == "replica":
                    replica = self.cluster.replicas[which]
                    owed = await unsaved(self.http, replica.url)
                    self._log(t0, f"kill -9 {replica.name} ({'?' if owed is None else owed} sessions unsaved)")
                    await asyncio.to_thread(replica.restart, self.args.replica_down_s)
                    self._log(t0, f"{replica.name} up again")
                else:
                    self._log(t0, "redis shutdown")
                    await asyncio.to_thread(self.cluster.redis.restart, self.args.redis_down_s)
                    self._log(t0, "redis up again (AOF)")
            except Exception as exc:  # a process that would not come back: the checks start it again
                self._log(t0, f"{what} restart failed: {str(exc)[-300:]}")
                self.restarts["failed"] += 1
            else:
                self.restarts[what] += 1
            ready = time.monotonic() + self.args.settle_s


async def quiesce(http: httpx.AsyncClient, cluster: Cluster, timeout: float = QUIESCE_S) -> bool:
    """Every process up; True once every replica is healthy with no unsaved session, and what killed
    replicas left has been swept (their KV writers' liveness lapses, then a replica sweeps)."""
    if cluster.redis.proc is None or cluster.redis.proc.poll() is not None:
        await asyncio.to_thread(cluster.redis.start)
    for replica in cluster.replicas:
        if replica.proc is None or replica.proc.poll() is not None:
            await asyncio.to_thread(replica.restart, 0)
    deadline = time.monotonic() + timeout
    if not await all_saved(http, cluster, timeout):
        return False
    redis = cluster.redis.client(timeout=30)
    while await asyncio.to_thread(dead_writers, redis, cluster.namespace):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(1)
    return True


# --- the checks over HTTP ----------------------------------------------------------------------
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


async def check_host(http, cluster: Cluster, logs: list[SessionLog]) -> dict[str, dict[str, Any]]:
    """Per replica: used host bytes against its sessions'. A first pass reads every held session, which
    drops any stale copy (its restore holds no pages); the second measures, with /v1/stats read before
    and after it, until both agree."""
    tokens = {s.sid: s.token for s in logs}
    deleted = {s.sid for s in logs if s.deleted}
    out: dict[str, dict[str, Any]] = {}
    for replica in cluster.replicas:
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


async def check_histories(http, cluster: Cluster, logs: list[SessionLog]) -> dict[str, Any]:
    holders: dict[str, str] = {}
    for url in cluster.urls:
        for sid in await listing(http, url):
            holders.setdefault(sid, url)
    turns = Counter()
    bad: list[dict[str, Any]] = []
    lost_sessions: list[str] = []
    unreadable: list[str] = []
    checked = 0
    for s in logs:
        if s.deleted or s.delete_in_doubt:
            continue
        checked += 1
        turns["acknowledged"] += len(s.turns)
        urls = [holders.get(s.sid, cluster.urls[0])] + [u for u in cluster.urls if u != holders.get(s.sid)]
        answer = None
        for url in urls:
            r = await _get(http, f"{url}/v1/sessions/{s.sid}/export", headers={"x-session-token": s.token})
            if r is not None and r.status_code in (200, 404):
                answer = r
                break
        if answer is None:
            unreadable.append(s.sid)
        elif answer.status_code == 404:
            lost_sessions.append(s.sid)
            turns["lost"] += len(s.turns)
        else:
            data = answer.json()
            found = compare_history(s.turns, data["messages"], data["token_ids"], s.in_doubt)
            turns["lost"] += len(found.lost)
            turns["duplicated"] += len(found.duplicated)
            turns["changed"] += len(found.changed)
            turns["unexpected"] += found.unexpected
            if not found.ok:
                bad.append({"session": s.sid, "turns_acknowledged": len(s.turns), "gave_up": s.gave_up,
                            **found.as_dict()})
    return {"sessions": checked, "violations": len(bad) + len(lost_sessions) + len(unreadable), "turns": dict(turns),
            "lost_sessions": len(lost_sessions), "unreadable": len(unreadable), "examples": bad[:EXAMPLES],
            "lost_examples": lost_sessions[:EXAMPLES], "unreadable_examples": unreadable[:EXAMPLES]}


async def check_deleted(http, cluster: Cluster, logs: list[SessionLog], redis) -> dict[str, Any]:
    deleted = [s for s in logs if s.deleted]
    answering: list[dict[str, Any]] = []
    for s in deleted:
        answered = []
        for replica in cluster.replicas:
            r = await _get(http, f"{replica.url}/v1/sessions/{s.sid}", headers={"x-session-token": s.token})
            if r is None or r.status_code != 404:
                answered.append(f"{replica.name}: {r.status_code if r is not None else 'no answer'}")
        if answered:
            answering.append({"session": s.sid, "answered": answered})
    records = await asyncio.to_thread(
        lambda: sum(1 for s in deleted if record_of(redis, session_key(cluster.namespace, s.sid)) is not None))
    return {"sessions": len(deleted), "answering": len(answering), "records_left": records,
            "examples": answering[:EXAMPLES]}


async def check_orphans(cluster: Cluster, redis) -> dict[str, Any]:
    keys = await asyncio.to_thread(orphan_keys, redis, cluster.namespace)
    sessions = {session_of(cluster.namespace, k) for k in keys}
    return {"keys": len(keys), "sessions": len(sessions), "examples": keys[:EXAMPLES]}


def log_errors(cluster: Cluster) -> dict[str, int]:
    """``ERROR`` lines in each replica's output (requests that failed unexpectedly, engine errors): where
    to look when a check fails. Warnings (Redis unreachable, a stale copy dropped) are the run's normal."""
    out = {}
    for replica in cluster.replicas:
        try:
            lines = replica.log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        out[replica.name] = sum(1 for line in lines if line.startswith("ERROR"))
    return out


# --- the run ---------------------------------------------------------------------------------
async def soak(args, cluster: Cluster, say) -> dict[str, Any]:
    limits = httpx.Limits(max_keepalive_connections=0)  # a killed replica leaves no stale connection behind
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        model = (await http.get(f"{cluster.urls[0]}/v1/models")).json()["data"][0]["id"]
        opts = Options(model=model, mode=args.mode, max_tokens=args.max_tokens, turns=parse_range(args.session_turns),
                       move_prob=args.move_prob, think_s=args.think_s, timeout_s=args.timeout)
        tally = Tally()
        clients = [Client(i, http, cluster.urls, opts, tally, seed=args.seed * 1000 + i) for i in range(args.sessions)]
        faults = Faults(cluster, fault_plan(args), args, http, say)
        t0 = time.monotonic()
        stop_at, drain_at = t0 + args.duration, t0 + args.duration + args.drain
        fault_task = asyncio.create_task(faults.run(t0))
        with progress(int(args.duration), "bench soak", quiet=args.quiet, unit="s") as bar:
            async def tick():
                while True:
                    await asyncio.sleep(1)
                    bar.n = min(int(time.monotonic() - t0), int(args.duration))
                    bar.set_postfix(turns=tally.turns_done, failed=sum(tally.turns_failed.values()), refresh=True)

            ticker = asyncio.create_task(tick())
            await asyncio.gather(*(c.run(stop_at, drain_at) for c in clients))
            ticker.cancel()
        wall = time.monotonic() - t0
        faults.stop.set()
        await fault_task
        say(f"soak: clients done after {wall:.0f} s; {tally.turns_done} turns; checking")
        quiet = await quiesce(http, cluster)
        logs = [s for c in clients for s in c.sessions]
        redis = cluster.redis.client(timeout=30)
        host = await check_host(http, cluster, logs)
        histories = await check_histories(http, cluster, logs)
        deleted = await check_deleted(http, cluster, logs, redis)
        orphans = await check_orphans(cluster, redis)
    violations = {
        "history": histories["violations"],
        "lost_turns": histories["turns"].get("lost", 0),
        "duplicated_turns": histories["turns"].get("duplicated", 0),
        "deleted_answering": deleted["answering"],
        "orphan_keys": orphans["keys"],
        "host_slots": sum(1 for h in host.values() if not h["ok"]),
    }
    return {
        "soak": {
            "duration_s": args.duration, "sessions": args.sessions, "replicas": args.replicas, "mode": args.mode,
            "model": model, "budget": args.budget, "max_tokens": args.max_tokens,
            "host_tier_bytes": args.host_tier_mib * 1024 * 1024, "session_turns": list(opts.turns),
            "move_prob": args.move_prob, "restart_every_s": args.restart_every, "replica_down_s": args.replica_down_s,
            "redis_restart_at": args.redis_restart_at, "redis_down_s": args.redis_down_s, "settle_s": args.settle_s,
            "kill_unsaved": args.kill_unsaved, "seed": args.seed,
        },
        "server_command": cluster.replicas[0].command(),
        "wall_s": round(wall, 1),
        "turns_done": tally.turns_done,
        "turns_replayed": tally.replayed,
        "turns_failed": dict(sorted(tally.turns_failed.items())),
        "requests_failed": dict(sorted(tally.requests_failed.items())),
        "sessions_created": tally.sessions_created,
        "deletes": tally.deletes,
        "deletes_in_doubt": sum(1 for s in logs if s.delete_in_doubt),
        "sessions_surviving": sum(1 for s in logs if not s.deleted and not s.delete_in_doubt),
        "sessions_given_up": dict(Counter(s.gave_up for s in logs if s.gave_up)),
        "turns_in_doubt": sum(1 for s in logs if s.in_doubt is not None),
        "restarts": {k: faults.restarts[k] for k in ("replica", "redis", "failed")},
        "events": faults.events,
        "quiesced": quiet,
        "replica_errors": log_errors(cluster),
        "checks": {"history": histories, "deleted": deleted, "orphan_keys": orphans, "host_slots": host},
        "violations": violations,
        "ok": not any(violations.values()),
    }


async def run(args) -> dict[str, Any]:
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rkv-soak-"))
    try:
        cluster = Cluster(folder, args.replicas, replica_env(args), args.namespace)
        say(f"soak: starting Redis and {args.replicas} replicas in {folder}")
        await asyncio.to_thread(cluster.start)
        try:
            return await soak(args, cluster, say)
        finally:
            await asyncio.to_thread(cluster.close)
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif not args.quiet:
            say(f"soak: logs and the AOF kept in {folder}")


def main(args) -> int:
    result = asyncio.run(run(args))
    write_json(result, args.json_out)
    if not result["ok"]:
        bad = ", ".join(f"{k} {v}" for k, v in result["violations"].items() if v)
        print(f"soak: violations: {bad}", file=sys.stderr)
        return 1
    return 0
