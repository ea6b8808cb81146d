"""The faults of ``bench soak``, one at a time while clients chat: what each does, which apply to a run,
the plan (which fault when, on which replica) and the runner.

- ``kill``: SIGKILL a chat replica, start it again after ``--replica-down-s``;
- ``crash``: SIGKILL a Redis primary under ``appendfsync everysec`` (its last writes lost; ``Topology.crash``);
- ``failover``: a planned Sentinel or Cluster failover, nothing lost (not on a single Redis);
- ``cut``: a replica cut off from Redis for ``--cut-s`` (its proxy mutes every connection), the others not;
- ``slow``: a replica's Redis made slow (``--slow-delay-s`` before every chunk) for ``--slow-s``;
- ``pause``: a replica frozen (SIGSTOP) for ``--pause-s``, then resumed.

``cut`` and ``slow`` need the replicas' network namespaces; without them they are skipped, and said so.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any, NamedTuple

import httpx

from bench import soak_net
from bench.soak_fleet import Fleet

KINDS = ("kill", "crash", "failover", "cut", "slow", "pause")
REPLICA_KINDS = ("kill", "cut", "slow", "pause")  # the others strike Redis
NEEDS_NETNS = ("cut", "slow")
HEALTH_TIMEOUT_S = 5.0  # a replica frozen or cut off answers late or not at all: not waited for


class Fault(NamedTuple):
    at: float  # seconds into the run, at the earliest (one fault at a time: a long one delays the next)
    kind: str
    replica: int  # which replica; -1 for a fault of Redis


def parse_kinds(text: str | None) -> list[str] | None:
    """``--faults``: a comma list of ``KINDS`` (None: the default)."""
    if text is None:
        return None
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}: choose from {', '.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def applicable(kinds: list[str] | None, topology: str, netns: bool, why_not: str | None = None
               ) -> tuple[list[str], dict[str, str]]:
    """The kinds a run does, and those it skips with why: ``failover`` on a single Redis, ``cut`` and
    ``slow`` without namespaces. ``kinds`` None: every kind that applies (none is then reported skipped
    for the topology, only for the namespaces)."""
    skipped: dict[str, str] = {}
    chosen = list(KINDS) if kinds is None else list(kinds)
    if topology == "single" and "failover" in chosen:
        chosen.remove("failover")
        if kinds is not None:
            skipped["failover"] = "a single Redis has no replica to fail over to"
    if not netns:
        for kind in NEEDS_NETNS:
            if kind in chosen:
                chosen.remove(kind)
                skipped[kind] = f"no network namespaces ({why_not or 'off'})"
    return chosen, skipped


def fault_plan(kinds: list[str], every: float, duration: float, replicas: int) -> list[Fault]:
    """A fault every ``every`` seconds of ``duration``, the kinds in turn; each kind that strikes a
    replica takes the replicas in turn, offset by its place among the kinds, so that at one time two
    kinds (a cut, a slow) strike different replicas."""
    plan: list[Fault] = []
    seen: Counter = Counter()
    k = 1
    while kinds and every > 0 and every * k < duration:
        kind = kinds[(k - 1) % len(kinds)]
        replica = (seen[kind] + kinds.index(kind)) % replicas if kind in REPLICA_KINDS else -1
        seen[kind] += 1
        plan.append(Fault(every * k, kind, replica))
        k += 1
    return plan


async def unsaved(http: httpx.AsyncClient, url: str) -> int | None:
    """Sessions the replica holds that Redis lacks (``/healthz``); None while it or its Redis is not ok."""
    try:
        health = (await http.get(f"{url}/healthz", timeout=HEALTH_TIMEOUT_S)).json()
    except (httpx.HTTPError, ValueError):
        return None
    return int(health.get("unsaved_sessions") or 0) if health.get("status") == "ok" else None


async def all_saved(http: httpx.AsyncClient, urls: list[str], timeout: float) -> bool:
    """Wait until every replica is healthy with nothing unsaved; False if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        if all(n == 0 for n in [await unsaved(http, url) for url in urls]):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)


class Faults:
    """Runs the plan, one fault after another, until it ends or ``stop`` is set (a fault under way
    finishes first: its process comes back, its cut heals). Each waits ``settle_s`` after the one before
    and, unless ``kill_unsaved``, until every replica has saved what Redis missed (at most
    ``settle_max_s``): a turn acknowledged while a replica could not save lives in its memory until then,
    and killing it loses that by design. ``events``: the timeline, with what each fault reported."""

    def __init__(self, fleet: Fleet, plan: list[Fault], args, http: httpx.AsyncClient, say):
        self.fleet, self.plan, self.args, self.http, self.say = fleet, plan, args, http, say
        self.stop = asyncio.Event()
        self.done: Counter = Counter()
        self.failed: Counter = Counter()
        self.events: list[dict[str, Any]] = []
        self.last_end: float | None = None  # when the last fault was over

    def _log(self, t0: float, event: str, **detail) -> None:
        self.events.append({"t": round(time.monotonic() - t0, 1), "event": event, **detail})
        self.say(f"soak: {self.events[-1]['t']:.0f} s: {event}")

    async def run(self, t0: float) -> None:
        ready = t0
        for fault in self.plan:
            start = max(t0 + fault.at, ready)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, start - time.monotonic()))
            if self.stop.is_set():
                return
            if not self.args.kill_unsaved:
                waited = time.monotonic()
                saved = await all_saved(self.http, self.fleet.urls, self.args.settle_max_s)
                if not saved or time.monotonic() - waited > 1:
                    self._log(t0, f"waited {time.monotonic() - waited:.0f} s for the replicas to save"
                              + ("" if saved else " (gave up)"))
                if self.stop.is_set():
                    return
            name = fault.kind + (f" r{fault.replica}" if fault.replica >= 0 else "")
            began = round(time.monotonic() - t0, 1)
            try:
                detail = await self.strike(fault)
            except Exception as exc:  # a process that would not come back: the checks start it again
                self._log(t0, f"{name} failed: {str(exc)[-300:]}", kind=fault.kind, began=began, failed=True)
                self.failed[fault.kind] += 1
            else:
                self._log(t0, f"{name} done", kind=fault.kind, replica=fault.replica, began=began, **detail)
                self.done[fault.kind] += 1
            self.last_end = time.monotonic()
            ready = self.last_end + self.args.settle_s

    async def strike(self, fault: Fault) -> dict[str, Any]:
        """Do ``fault``; return once it is over (the process back, the cut healed), with what it reported."""
        a, topology = self.args, self.fleet.topology
        if fault.kind == "crash":
            return await asyncio.to_thread(topology.crash)
        if fault.kind == "failover":
            return await asyncio.to_thread(topology.failover)
        replica = self.fleet.replicas[fault.replica]
        if fault.kind == "kill":
            owed = await unsaved(self.http, replica.url)
            await asyncio.to_thread(self.fleet.kill, fault.replica, a.replica_down_s)
            return {"unsaved_sessions": owed}
        if fault.kind == "pause":
            await asyncio.to_thread(soak_net.pause, replica.proc.pid, a.pause_s)
            return {"seconds": a.pause_s}
        net = self.fleet.nets[fault.replica]
        seconds = a.cut_s if fault.kind == "cut" else a.slow_s
        try:  # the proxy heals by itself after ``seconds`` too, should this process stall
            if fault.kind == "cut":
                await asyncio.to_thread(net.cut, seconds)
            else:
                await asyncio.to_thread(net.slow, a.slow_delay_s, seconds)
            await asyncio.sleep(seconds)
        finally:
            proxy = await asyncio.to_thread(net.heal)
        return {"seconds": seconds, "proxy": proxy}
