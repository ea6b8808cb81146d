"""A client of ``bench soak``: sessions one after another, each a random number of short turns through
the REST API (``POST /v1/chat/completions`` with ``x-session-id``), then deleted and replaced.

Every turn carries the session's acknowledged history and an ``Idempotency-Key``; an attempt that
fails (a replica killed mid-turn, Redis down, the session busy) is sent again under the same key,
on another replica where it makes sense, until it is acknowledged: a turn that ran but whose answer
was lost is answered from the session's record, never run twice, and a history the server does not
hold answers ``history_mismatch``. Each client sticks to a replica and moves its session to another one
now and then (``move_prob``), and whenever its own fails, so sessions move between replicas through
their Redis records.

Redis may lose its last writes (a crash under ``appendfsync everysec``, a failover to a lagging
replica): the server then answers ``session_diverged`` once, or (nobody holding the lost turns any more)
every replica keeps answering ``history_mismatch``. The client then reads the session's history back,
counts the acknowledged turns it lacks as lost (a violation where the turn was acknowledged durable:
``done.storage.durable``) and goes on from the history as it stands (``bench.soak_checks.reconcile``).
A turn that failed half-way (refused when the host tier filled, or an engine error) stays in the history
with what it had generated, flagged: its retry answers ``history_mismatch``, and the client, finding its
history and then that turn there, goes on from it at once.

What a client keeps (``bench.soak_log``) is what the checks compare (``bench.soak_checks``): per session
the turns it was acknowledged (message, reply, what its save gave, the session's token ids read back right
after), the turns it lost and was told of, the turn it sent last and never saw acknowledged, and whether
(and how durably) it deleted the session.
"""
from __future__ import annotations

import asyncio
import random
import time

import httpx

from bench.common import GREEDY
from bench.soak_checks import Acked, reconcile
from bench.soak_log import Mismatches, Options, SessionLog, Tally, error_code, error_detail, transport_kind

PROMPTS = ("Name a fruit.", "Name a colour.", "Say hello.", "Name an animal.", "Give a number.",
           "Name a city.", "Say yes or no.", "Name a tree.")
NOT_FOUND_GIVE_UP = 3  # a live session every replica tried calls unknown this many times: lost


class Client:
    def __init__(self, index: int, http: httpx.AsyncClient, urls: list[str], opts: Options, tally: Tally,
                 seed: int):
        self.index = index
        self.http = http
        self.urls = urls
        self.opts = opts
        self.tally = tally
        self.rng = random.Random(seed)
        self.home = index % len(urls)
        self.sessions: list[SessionLog] = []

    # --- where ---------------------------------------------------------------------------------
    def _away(self) -> None:
        """Its replica failed it: go to the next one."""
        self.home = (self.home + 1) % len(self.urls)

    def _pick(self, first_attempt: bool) -> str:
        if first_attempt and len(self.urls) > 1 and self.rng.random() < self.opts.move_prob:
            self.home = self.rng.choice([i for i in range(len(self.urls)) if i != self.home])
        return self.urls[self.home]

    async def _backoff(self, attempt: int) -> None:
        await asyncio.sleep(min(2.0, 0.1 * 2 ** min(attempt, 5)) * (0.5 + self.rng.random()))

    # --- the loop ------------------------------------------------------------------------------
    async def run(self, stop_at: float, drain_at: float) -> None:
        """Sessions until ``stop_at``; a turn or delete under way then may retry until ``drain_at``."""
        while time.monotonic() < stop_at:
            session = await self.create(stop_at)
            if session is None:
                return
            life = self.rng.randint(*self.opts.turns)
            while len(session.turns) < life and time.monotonic() < stop_at and session.gave_up is None:
                if not await self.turn(session, drain_at):
                    break
                await asyncio.sleep(self.rng.uniform(0, self.opts.think_s))
            if session.gave_up is None and session.in_doubt is None and len(session.turns) >= life:
                await self.delete(session, drain_at)

    async def create(self, stop_at: float) -> SessionLog | None:
        attempt = 0
        while time.monotonic() < stop_at:
            url = self._pick(attempt == 0)
            attempt += 1
            try:
                r = await self.http.post(f"{url}/v1/sessions", json={"mode": self.opts.mode})
            except httpx.TransportError as exc:  # it may have been made: a session nobody knows, not a fault
                self.tally.requests_failed[transport_kind(exc)] += 1
                self._away()
                await self._backoff(attempt)
                continue
            if r.status_code == 201:
                info = r.json()
                session = SessionLog(info["session_id"], info["token"], self.index)
                self.sessions.append(session)
                self.tally.sessions_created += 1
                return session
            self.tally.requests_failed[error_code(r)] += 1
            self._away()
            await self._backoff(attempt)
        return None

    async def turn(self, s: SessionLog, drain_at: float) -> bool:
        """One turn, sent until acknowledged, or until the session's history was read back after Redis lost
        writes (the next turn goes on from it); False when the client gave up on it (it stays in doubt)."""
        k = s.begun
        s.begun += 1
        content = f"{self.rng.choice(PROMPTS)} (turn {k})"
        s.sent[content] = None
        body = {"model": self.opts.model, "messages": [*s.history(), {"role": "user", "content": content}],
                "max_tokens": self.opts.max_tokens, **GREEDY}
        headers = {**s.headers, "idempotency-key": f"{s.sid}:{k}"}
        attempt, not_found, mismatch, failures = 0, 0, Mismatches(), []
        while time.monotonic() < drain_at:
            url = self._pick(attempt == 0)
            attempt += 1
            try:
                r = await self.http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            except httpx.TransportError as exc:
                self.tally.turns_failed[transport_kind(exc)] += 1
                failures.append(transport_kind(exc))
                self._away()
                await self._backoff(attempt)
                continue
            if r.status_code == 200:
                self._acknowledged(s, k, content, r, attempt, failures)
                s.turns[-1].token_ids = await self.read_ids(s, url)
                return True
            kind = error_code(r)
            self.tally.turns_failed[kind] += 1
            failures.append(error_detail(r))
            s.in_doubt = content
            if kind == "session_diverged":  # said once: the store lost turns another replica went on without
                self.tally.diverged_told += 1
                return await self.read_back(s, url, k, drain_at)
            if kind == "history_mismatch":
                if await self.went_on(s, url, k):
                    return True
                if mismatch.persists(url, len(self.urls)):
                    return await self.read_back(s, url, k, drain_at)
                self._away()
            elif kind == "session_not_found":
                not_found += 1
                if not_found >= NOT_FOUND_GIVE_UP * len(self.urls):
                    s.gave_up = "not_found"
                    return False
                self._away()
            elif r.status_code >= 500:
                self._away()
            elif r.status_code not in (409, 429):  # a refusal retrying will not change
                s.gave_up = kind
                return False
            await self._backoff(attempt)
        s.in_doubt = content
        return False

    def _acknowledged(self, s: SessionLog, k: int, content: str, r: httpx.Response, attempts: int,
                      failures: list[str]) -> None:
        answer = r.json()
        storage = answer.get("storage") or {}  # absent on an answer given again from a record
        durability = storage.get("durability", "unknown")
        usage = answer.get("usage") or {}
        s.turns.append(Acked(k, content, answer["choices"][0]["message"]["content"], durability=durability,
                             durable=bool(storage.get("durable")), replica=r.headers.get("x-replica"),
                             at=time.monotonic(), attempts=attempts, failures=failures,
                             usage=(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))))
        s.sent[content] = s.turns[-1].reply
        s.in_doubt = None
        self.tally.turns_done += 1
        self.tally.replayed += attempts > 1
        self.tally.acks[durability] += 1

    async def _export(self, s: SessionLog, url: str) -> httpx.Response | None:
        """``GET /v1/sessions/{id}/export`` on ``url``; None (counted) where it did not answer."""
        try:
            return await self.http.get(f"{url}/v1/sessions/{s.sid}/export", headers={"x-session-token": s.token})
        except httpx.TransportError as exc:
            self.tally.requests_failed[transport_kind(exc)] += 1
            return None

    async def read_ids(self, s: SessionLog, url: str) -> list[int] | None:
        """The session's token ids read back from the replica that just answered (None if it cannot)."""
        r = await self._export(s, url)
        if r is not None and r.status_code != 200:
            self.tally.requests_failed[error_code(r)] += 1
        return r.json()["token_ids"] if r is not None and r.status_code == 200 else None

    async def read_back(self, s: SessionLog, url: str, k: int, drain_at: float) -> bool:
        """Read the session's history back and go on from it (``reconcile``): the acknowledged turns it
        lacks are lost (a violation if any was durable), the turn in doubt kept if it ran. False when it
        cannot be read (the turn stays in doubt) or the session is gone."""
        attempt = 0
        while time.monotonic() < drain_at:
            attempt += 1
            r = await self._export(s, url)
            if r is not None and r.status_code == 200:
                break
            if r is not None:
                self.tally.requests_failed[error_code(r)] += 1
                if r.status_code == 404:  # nobody holds it any more: the checks weigh what it had
                    s.gave_up = "not_found"
                    return False
            self._away()
            url = self.urls[self.home]
            await self._backoff(attempt)
        else:
            return False
        self._go_on(s, r.json(), k)
        return True

    async def went_on(self, s: SessionLog, url: str, k: int) -> bool:
        """Whether the history holds every acknowledged turn and then the turn in doubt (it ran, and failed
        half-way or lost its answer; a failed one stays, flagged): then the client goes on from it at once,
        nothing lost. Else the mismatch is a store that lost writes, or a holder out of reach: wait."""
        r = await self._export(s, url)
        if r is None or r.status_code != 200:
            return False
        data = r.json()
        found = reconcile(s.turns, data["messages"], s.in_doubt, k, s.sent)
        if found.lost or found.foreign or found.returned or found.adopted is None:
            return False
        self._go_on(s, data, k)
        return True

    def _go_on(self, s: SessionLog, data: dict, k: int) -> None:
        """Take the history read back (``data``, an export) as the session's (``reconcile``), counting what
        the client lost."""
        found = reconcile(s.turns, data["messages"], s.in_doubt, k, s.sent)
        if found.adopted is not None and not found.foreign and not found.returned:
            found.adopted.token_ids = data["token_ids"]
        s.turns, s.in_doubt = found.turns, None
        s.lost += found.lost
        s.foreign += len(found.foreign)
        if found.foreign and s.foreign_seen is None:
            s.foreign_seen = {"at": time.monotonic(), "doubt_index": k,
                              "client_turns": len(found.kept) + len(found.lost),
                              "messages": [{key: (v[:40] if isinstance(v, str) else v) for key, v in m.items()}
                                           for m in data["messages"]][-80:]}
        s.returned += len(found.returned)
        self.tally.reconciles += 1
        self.tally.lost_durable += len(found.lost_durable)
        self.tally.lost_not_durable += len(found.lost) - len(found.lost_durable)

    async def delete(self, s: SessionLog, drain_at: float) -> None:
        """Delete until answered 204, or 404 everywhere after an attempt that may have deleted it."""
        attempt, maybe = 0, False
        while time.monotonic() < drain_at:
            url = self._pick(attempt == 0)
            attempt += 1
            try:
                r = await self.http.delete(f"{url}/v1/sessions/{s.sid}", headers={"x-session-token": s.token})
            except httpx.TransportError as exc:
                self.tally.requests_failed[transport_kind(exc)] += 1
                maybe = True
                self._away()
                await self._backoff(attempt)
                continue
            if r.status_code == 204:  # how durably the tombstone was written
                self._deleted(s, r.headers.get("x-rkv-durability", "unknown"))
                return
            kind = error_code(r)
            self.tally.requests_failed[kind] += 1
            # A 404 from a replica that lacks the session (its only copy on another, cut off from Redis) says
            # nothing: it counts once every replica says so, as deleted after an attempt that may have done it
            # (how durably unknown), else as a live session nobody deleted answering unknown (the checks see it).
            if r.status_code == 404 and await self._unknown_everywhere(s):
                if maybe:
                    self._deleted(s, "unknown")
                else:
                    s.gave_up = "not_found"
                return
            maybe = maybe or (r.status_code >= 500 and kind != "store_unavailable")  # that one deleted nothing
            self._away()
            await self._backoff(attempt)
        s.delete_in_doubt = True

    def _deleted(self, s: SessionLog, durability: str) -> None:
        s.deleted, s.delete_durability = True, durability
        self.tally.deletes += 1
        self.tally.deletes_by_durability[durability] += 1

    async def _unknown_everywhere(self, s: SessionLog) -> bool:
        for url in self.urls:
            try:
                r = await self.http.get(f"{url}/v1/sessions/{s.sid}", headers={"x-session-token": s.token})
            except httpx.TransportError:
                return False
            if r.status_code != 404:
                return False
        return True
