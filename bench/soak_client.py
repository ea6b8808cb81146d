"""A client of ``bench soak``: sessions one after another, each a random number of short turns through
the REST API (``POST /v1/chat/completions`` with ``x-session-id``), then deleted and replaced.

Every turn carries the session's acknowledged history and an ``Idempotency-Key``; an attempt that
fails (a replica killed mid-turn, Redis down, the session busy) is sent again under the same key,
on another replica where it makes sense, until it is acknowledged: a turn that ran but whose answer
was lost is answered from the session's record, never run twice, and a history the server does not
hold answers ``history_mismatch``. Each client sticks to a replica and moves its session to another one
now and then (``move_prob``), and whenever its own fails, so sessions move between replicas through
their Redis records.

What a client keeps is what the checks compare (``bench.soak_checks``): per session the turns it
was acknowledged (message, reply, the session's token ids read back right after), the turn it sent
last and never saw acknowledged, and whether it deleted the session.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.soak_checks import Acked

PROMPTS = ("Name a fruit.", "Name a colour.", "Say hello.", "Name an animal.", "Give a number.",
           "Name a city.", "Say yes or no.", "Name a tree.")
KINDS = {"session_busy": "busy"}  # error codes reported under a shorter name
MISMATCH_GIVE_UP_S = 20.0  # a history the replicas keep refusing this long: the session diverged
NOT_FOUND_GIVE_UP = 3  # a live session every replica tried calls unknown this many times: lost


@dataclass
class Options:
    model: str
    mode: str = "tiered"
    max_tokens: int = 4
    turns: tuple[int, int] = (3, 20)  # turns of a session before its client deletes it
    move_prob: float = 0.25
    think_s: float = 0.2
    timeout_s: float = 120.0


@dataclass
class SessionLog:
    sid: str
    token: str
    client: int
    turns: list[Acked] = field(default_factory=list)
    in_doubt: str | None = None  # the message of a turn sent and never acknowledged
    deleted: bool = False
    delete_in_doubt: bool = False
    gave_up: str | None = None  # why the client stopped using it before deleting it

    @property
    def headers(self) -> dict[str, str]:
        return {"x-session-id": self.sid, "x-session-token": self.token}

    def history(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for t in self.turns:
            out += [{"role": "user", "content": t.content}, {"role": "assistant", "content": t.reply}]
        return out


@dataclass
class Tally:
    """What all clients did: turns acknowledged, attempts failed by kind, deletes and sessions."""

    turns_done: int = 0
    turns_failed: Counter = field(default_factory=Counter)
    requests_failed: Counter = field(default_factory=Counter)  # creates, deletes, read-backs
    deletes: int = 0
    sessions_created: int = 0
    replayed: int = 0  # turns acknowledged on a retry (the first attempt's answer was lost)


def error_code(response: httpx.Response) -> str:
    try:
        code = response.json()["error"]["code"]
    except Exception:  # not our error body
        code = f"http_{response.status_code}"
    return KINDS.get(code, code)


def transport_kind(exc: httpx.TransportError) -> str:
    return "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"


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
        """One turn, sent until acknowledged; False when the client gave up on it (it stays in doubt)."""
        k = len(s.turns)
        content = f"{self.rng.choice(PROMPTS)} (turn {k})"
        body = {"model": self.opts.model, "messages": [*s.history(), {"role": "user", "content": content}],
                "max_tokens": self.opts.max_tokens, "temperature": 0}
        headers = {**s.headers, "idempotency-key": f"{s.sid}:{k}"}
        attempt, mismatch_since, not_found = 0, None, 0
        while time.monotonic() < drain_at:
            url = self._pick(attempt == 0)
            attempt += 1
            try:
                r = await self.http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            except httpx.TransportError as exc:
                self.tally.turns_failed[transport_kind(exc)] += 1
                self._away()
                await self._backoff(attempt)
                continue
            if r.status_code == 200:
                reply = r.json()["choices"][0]["message"]["content"]
                turn = Acked(k, content, reply)
                s.turns.append(turn)
                s.in_doubt = None
                self.tally.turns_done += 1
                self.tally.replayed += attempt > 1
                turn.token_ids = await self.read_ids(s, url)
                return True
            kind = error_code(r)
            self.tally.turns_failed[kind] += 1
            s.in_doubt = content
            if kind == "history_mismatch":
                mismatch_since = mismatch_since or time.monotonic()
                if time.monotonic() - mismatch_since > MISMATCH_GIVE_UP_S:
                    s.gave_up = "diverged"
                    return False
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

    async def read_ids(self, s: SessionLog, url: str) -> list[int] | None:
        """The session's token ids read back from the replica that just answered (None if it cannot)."""
        try:
            r = await self.http.get(f"{url}/v1/sessions/{s.sid}/export", headers={"x-session-token": s.token})
        except httpx.TransportError as exc:
            self.tally.requests_failed[transport_kind(exc)] += 1
            return None
        if r.status_code != 200:
            self.tally.requests_failed[error_code(r)] += 1
            return None
        return r.json()["token_ids"]

    async def delete(self, s: SessionLog, drain_at: float) -> None:
        """Delete until answered 204, or 404 after an attempt that may have deleted it."""
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
            if r.status_code == 204 or (r.status_code == 404 and maybe):
                s.deleted = True
                self.tally.deletes += 1
                return
            kind = error_code(r)
            self.tally.requests_failed[kind] += 1
            if r.status_code == 404:  # a live session nobody deleted answers as unknown: the checks see it
                s.gave_up = "not_found"
                return
            maybe = maybe or r.status_code >= 500
            self._away()
            await self._backoff(attempt)
        s.delete_in_doubt = True
