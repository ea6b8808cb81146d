"""``rocketkv-mt bench soak``: clients chat through faults of Redis, of the network and of the replicas, then
checks that nothing acknowledged durable was lost, nothing deleted answers, no wrong KV was served and
nothing was left behind in Redis (issue 40).

A Redis topology (``--topology``: one ``redis-server``; a primary and a replica behind three Sentinels; a
Cluster of three masters with a replica each; AOF with ``appendfsync everysec`` everywhere) and
``--replicas`` chat replicas, each ``rocketkv-mt serve --no-ray`` in a process of its own (mode ``tiered``,
a small token budget and host tier, a few tokens a reply, one thread: quick on a small CPU), each in its
own network namespace where the machine allows (``--netns``), its Redis traffic through a proxy the soak
owns (``bench.soak_fleet``). ``--sessions`` clients (``bench.soak_client``) talk to them through the REST
API for ``--duration`` seconds: each opens a session, takes a random number of short turns and deletes
it, then opens the next. Meanwhile a fault every ``--fault-every`` seconds, one at a time, the kinds and
replicas in turn (``bench.soak_faults``): replica kills, Redis primaries crashed (their last writes lost),
Sentinel and Cluster failovers, a replica cut off from Redis, one made slow, one paused.

Then, with every fault undone and every replica's unsaved sessions saved (``bench.soak_verify``):
histories (every turn acknowledged durable there, bit for bit; one acknowledged as not durable may be
missing, and its client was told), deletes, host slots, records naming missing KV; the replicas stop, a
reference run replays every surviving conversation (``--reference all``: the deleted ones too, as their
clients were acknowledged them) on a fresh replica without faults and its replies must be the soak's
(``bench.soak_reference``), and once the pending TTL has passed no key of the session namespace may lack
a record naming it. Keys per session and Redis round trips per turn are reported.

Every violation is counted and listed; the command exits 1 when there is any.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from app.progress import progress
from bench.common import write_json
from bench.soak_client import Client
from bench.soak_log import Options, SessionLog, Tally
from bench.soak_faults import Faults, applicable, fault_plan, parse_kinds
from bench.soak_fleet import Fleet, netns_choice
from bench.soak_reference import client_transcript, reference_run
from bench.soak_verify import (check_deleted, check_histories, check_host, check_missing_kv, check_orphans,
                               key_figures, log_figures, quiesce, server_transcripts)

QUIESCE_S = 60.0  # how long the replicas get to save what Redis missed
ORPHAN_MARGIN_S = 5.0  # past the pending TTL: Redis reclaims an expired key on its next look


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_n, hi_n = int(lo), int(hi or lo)
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"a range of turns is MIN-MAX with 1 <= MIN <= MAX, not {text!r}")
    return lo_n, hi_n


def min_replicas(args) -> int:
    """``--min-replicas``, by default 1 where the topology has replicas (a save is durable once one has it)."""
    if args.min_replicas is not None:
        return args.min_replicas
    return 0 if args.topology == "single" else 1


def replica_env(args) -> dict[str, str]:
    env = {
        "RKV_MODE": args.mode,
        "RKV_TOKEN_BUDGET": str(args.budget),
        "RKV_MAX_NEW_TOKENS": str(args.max_tokens),
        "RKV_HOST_TIER_BYTES": str(args.host_tier_mib * 1024 * 1024),
        "RKV_THREADS": os.environ.get("RKV_THREADS", "1"),
        "RKV_REDIS_PENDING_TTL_S": str(args.pending_ttl_s),
        "RKV_REDIS_MIN_REPLICAS": str(min_replicas(args)),
    }
    if args.model:
        env["RKV_MODEL"] = args.model
    return env


def deleted_conversations(logs: list[SessionLog]) -> dict[str, list[dict]]:
    """The conversations of deleted sessions as their clients were acknowledged them, where that is the whole
    of it (no turn found lost along the way): their replies can be checked against a reference run too."""
    return {s.sid: s.conversation() for s in logs if s.deleted and s.turns and not s.lost and not s.foreign}


def timeline(s: SessionLog, t0: float, upto: int) -> list[dict[str, Any]]:
    """A session's acknowledged turns up to its ``upto``-th as its client saw them: which replica answered,
    when (seconds into the run), what the attempts before failed with, how durably saved."""
    return [{"turn": i, "replica": t.replica, "t": round(t.at - t0, 1) if t.at else None, "failures": t.failures,
             "durability": t.durability} for i, t in enumerate(s.turns[: upto + 1])]


async def chat(args, fleet: Fleet, faults: Faults, http: httpx.AsyncClient, model: str
               ) -> tuple[list[Client], Tally, float]:
    """The clients for ``--duration`` (and the drain), the faults beside them; when they started."""
    opts = Options(model=model, mode=args.mode, max_tokens=args.max_tokens, turns=parse_range(args.session_turns),
                   move_prob=args.move_prob, think_s=args.think_s, timeout_s=args.timeout)
    tally = Tally()
    clients = [Client(i, http, fleet.urls, opts, tally, seed=args.seed * 1000 + i) for i in range(args.sessions)]
    t0 = fleet.clock.epoch = time.monotonic()  # the replicas' timed logs count from here too
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
    faults.stop.set()
    await fault_task
    return clients, tally, t0


async def soak(args, fleet: Fleet, kinds: list[str], skipped: dict[str, str], say) -> dict[str, Any]:
    limits = httpx.Limits(max_keepalive_connections=0)  # a killed replica leaves no stale connection behind
    plan = fault_plan(kinds, args.fault_every, args.duration, args.replicas)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        model = (await http.get(f"{fleet.urls[0]}/v1/models")).json()["data"][0]["id"]
        faults = Faults(fleet, plan, args, http, say)
        clients, tally, t0 = await chat(args, fleet, faults, http, model)
        wall = time.monotonic() - t0
        say(f"soak: clients done after {wall:.0f} s; {tally.turns_done} turns; checking")
        quiet = await quiesce(http, fleet, QUIESCE_S)
        logs = [s for c in clients for s in c.sessions]
        totals, _ = await asyncio.to_thread(fleet.totals)
        host = await check_host(http, fleet, logs)
        histories, finals = await check_histories(http, fleet, logs)
        primaries = await asyncio.to_thread(fleet.topology.primaries)
        deleted = await check_deleted(http, fleet, logs, primaries)
        missing = await check_missing_kv(primaries, fleet.namespace, totals["caches_kv_restore_failed"])
        transcripts = await server_transcripts(http, fleet, logs, finals) if args.reference != "off" else {}
    transcripts |= {s.sid: t for s in logs if s.deleted and (t := client_transcript(s)) is not None}
    by_sid = {s.sid: s for s in logs}
    for example in histories["examples"] + histories["lost_examples"]:
        example["timeline"] = timeline(by_sid[example["session"]], t0, len(by_sid[example["session"]].turns))
    replica_logs = log_figures(fleet)
    stopped = await asyncio.to_thread(fleet.stop_replicas)  # their pending KV is no one's from now on
    replies = None
    if args.reference != "off":
        conversations = {**finals, **(deleted_conversations(logs) if args.reference == "all" else {})}
        say(f"soak: reference run of {len(conversations)} sessions")
        replies = await reference_run(conversations, replica_env(args), fleet.dir / "reference", args.max_tokens,
                                      args.mode, args.timeout, transcripts)
        for example in replies["examples"]:  # who answered each turn up to the first that differs, and when
            example["timeline"] = timeline(by_sid[example["session"]], t0, example["turn"])
    left = stopped + args.pending_ttl_s + ORPHAN_MARGIN_S - time.monotonic()
    if left > 0:
        say(f"soak: waiting {left:.0f} s for pending KV to expire")
        await asyncio.sleep(left)
    primaries = await asyncio.to_thread(fleet.topology.primaries)
    orphans = await check_orphans(primaries, fleet.namespace)
    keys = await key_figures(primaries, fleet.namespace)
    turns = histories["turns"]
    violations = {
        "history": histories["violations"],
        "lost_turns": turns.get("lost", 0),
        "duplicated_turns": turns.get("duplicated", 0),
        "deleted_answering": deleted["answering"],
        "replies_differ": replies["differ"] if replies else 0,
        "missing_kv": missing["unaccounted"],
        "orphan_keys": orphans["keys"],
        "host_slots": sum(1 for h in host.values() if not h["ok"]),
    }
    acks = tally.acks
    return {
        "soak": {
            "topology": args.topology, "duration_s": args.duration, "sessions": args.sessions,
            "replicas": args.replicas, "mode": args.mode, "model": model, "budget": args.budget,
            "max_tokens": args.max_tokens, "host_tier_bytes": args.host_tier_mib * 1024 * 1024,
            "session_turns": list(parse_range(args.session_turns)), "move_prob": args.move_prob,
            "faults": kinds, "fault_every_s": args.fault_every, "replica_down_s": args.replica_down_s,
            "cut_s": args.cut_s, "slow_s": args.slow_s, "slow_delay_s": args.slow_delay_s, "pause_s": args.pause_s,
            "pending_ttl_s": args.pending_ttl_s, "min_replicas": min_replicas(args), "netns": fleet.netns,
            "settle_s": args.settle_s, "kill_unsaved": args.kill_unsaved, "reference": args.reference,
            "seed": args.seed,
        },
        "topology": {"kind": args.topology, "url": fleet.topology.url, "netns": fleet.netns},
        "server_command": fleet.replicas[0].command(),
        "wall_s": round(wall, 1),
        "turns_done": tally.turns_done,
        "acknowledged": {"durable": sum(n for d, n in acks.items() if d in ("fsync", "replicated")),
                         "not_durable": sum(n for d, n in acks.items() if d not in ("fsync", "replicated", "none")),
                         "not_saved": acks.get("none", 0), "by_durability": dict(sorted(acks.items()))},
        "turns_lost_not_durable": tally.lost_not_durable + turns.get("lost_not_durable", 0),
        "turns_replayed": tally.replayed,
        "turns_failed": dict(sorted(tally.turns_failed.items())),
        "requests_failed": dict(sorted(tally.requests_failed.items())),
        "reconciles": tally.reconciles,
        "diverged_told": tally.diverged_told,
        "sessions_created": tally.sessions_created,
        "deletes": tally.deletes,
        "deletes_by_durability": dict(sorted(tally.deletes_by_durability.items())),
        "deletes_in_doubt": sum(1 for s in logs if s.delete_in_doubt),
        "sessions_surviving": sum(1 for s in logs if not s.deleted and not s.delete_in_doubt),
        "sessions_given_up": dict(Counter(s.gave_up for s in logs if s.gave_up)),
        "turns_in_doubt": sum(1 for s in logs if s.in_doubt is not None),
        # Turns a client let go of (not saved, or in doubt) found saved back later by the replica holding them.
        "turns_returned": sum(s.returned for s in logs),
        # Turns the client was told failed, found kept in the history with a partial reply (flagged ``error``).
        "turns_unfinished": sum(1 for s in logs for t in s.turns if t.unfinished),
        "faults": {"planned": dict(Counter(f.kind for f in plan)), "done": dict(faults.done),
                   "failed": dict(faults.failed), "skipped": skipped},
        "events": faults.events,
        "server": dict(sorted(totals.items())),
        "keys_per_session": keys,
        "round_trips_per_turn": round(totals["redis_round_trips"] / tally.turns_done, 2) if tally.turns_done else None,
        "quiesced": quiet,
        "replica_logs": replica_logs,
        "checks": {"history": histories, "deleted": deleted, "replies": replies, "missing_kv": missing,
                   "orphan_keys": orphans, "host_slots": host},
        "violations": violations,
        "ok": not any(violations.values()),
    }


def summary(result: dict[str, Any]) -> str:
    """The run's figures in a line: turns, faults, replays and restores, acknowledgements, violations."""
    s, a, f = result["server"], result["acknowledged"], result["faults"]["done"]
    bad = ", ".join(f"{k} {v}" for k, v in result["violations"].items() if v) or "none"
    return (f"soak: {result['turns_done']} turns ({a['durable']} durable, {a['not_durable']} not durable, "
            f"{a['not_saved']} not saved; {result['turns_lost_not_durable']} not durable lost, told); faults "
            + (", ".join(f"{k} {n}" for k, n in f.items()) or "none")
            + f"; KV restored {s.get('caches_kv_restored', 0)}, restores that found KV gone "
            f"{s.get('caches_kv_restore_failed', 0)}, replayed {s.get('caches_replayed', 0)}, re-prefilled "
            f"{s.get('caches_reprefilled', 0)}; store losses {s.get('store_losses', 0)}, divergences "
            f"{s.get('divergences', 0)}; keys per session {result['keys_per_session']['mean']} (max "
            f"{result['keys_per_session']['max']}), round trips per turn {result['round_trips_per_turn']}; "
            f"violations: {bad}")


async def run(args) -> dict[str, Any]:
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    netns, why = netns_choice(args.netns)
    kinds, skipped = applicable(parse_kinds(args.faults), args.topology, netns, why)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rkv-soak-"))
    try:
        fleet = Fleet(folder, args.topology, args.replicas, replica_env(args), args.namespace, netns)
        say(f"soak: starting {args.topology} Redis and {args.replicas} replicas in {folder}"
            + ("" if netns else f" (no network namespaces: {why})"))
        try:
            await asyncio.to_thread(fleet.start)
            return await soak(args, fleet, kinds, skipped, say)
        finally:
            await asyncio.to_thread(fleet.close)
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif not args.quiet:
            say(f"soak: logs and Redis files kept in {folder}")


def _interrupted(*_) -> None:
    raise KeyboardInterrupt


def main(args) -> int:
    # Stopped (SIGTERM): leave as an interrupt does, through every ``finally`` that takes the fleet down
    # (its Redis servers, proxies and network namespaces would outlive the soak otherwise).
    signal.signal(signal.SIGTERM, _interrupted)
    result = asyncio.run(run(args))
    write_json(result, args.json_out)
    print(summary(result), file=sys.stderr)
    return 0 if result["ok"] else 1
