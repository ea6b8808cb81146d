"""What a ``bench soak`` client keeps and counts (``bench.soak_client``): its options, each session's log
(what the checks compare: ``bench.soak_checks``), the tally of all clients, when ``history_mismatch``
answers persist, and how a failed answer is named.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.soak_checks import Acked

KINDS = {"session_busy": "busy"}  # error codes reported under a shorter name
# A history every replica keeps refusing this long (every one of them, or any for RECONCILE_ANY_S):
# nobody holds the turns Redis lost, so the client reads the history back and goes on from it.
RECONCILE_AFTER_S, RECONCILE_ANY_S = 20.0, 90.0


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
    begun: int = 0  # turns begun: each new turn's index, so messages and keys never repeat in a session
    lost: list[Acked] = field(default_factory=list)  # acknowledged turns a read-back showed gone
    foreign: int = 0  # turns a read-back showed that the client never sent
    foreign_seen: dict[str, Any] | None = None  # the first read-back that showed such turns: where to look
    returned: int = 0  # turns it let go of (not saved, or in doubt) that a read-back showed saved back since
    sent: dict[str, str | None] = field(default_factory=dict)  # every message sent -> the reply acknowledged
    deleted: bool = False
    delete_in_doubt: bool = False
    delete_durability: str | None = None  # ``x-rkv-durability`` of the delete ("unknown": not seen)
    gave_up: str | None = None  # why the client stopped using it before deleting it

    @property
    def headers(self) -> dict[str, str]:
        return {"x-session-id": self.sid, "x-session-token": self.token}

    def history(self) -> list[dict[str, Any]]:
        """The messages as a turn sends them."""
        out: list[dict[str, Any]] = []
        for t in self.turns:
            out += [{"role": "user", "content": t.content}, {"role": "assistant", "content": t.reply}]
        return out

    def conversation(self) -> list[dict[str, Any]]:
        """``history`` with an unfinished reply flagged ``error``, as the server's history reads: what the
        reference run needs to know where to stop."""
        out = self.history()
        for i, t in enumerate(self.turns):
            if t.unfinished:
                out[2 * i + 1]["error"] = True
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
    acks: Counter = field(default_factory=Counter)  # turns acknowledged, by ``storage.durability``
    deletes_by_durability: Counter = field(default_factory=Counter)
    reconciles: int = 0  # histories read back after Redis lost writes
    diverged_told: int = 0  # ``session_diverged`` answers
    lost_not_durable: int = 0  # acknowledged turns found gone, each acknowledged as not durable (told)
    lost_durable: int = 0  # ... acknowledged durable: violations


@dataclass
class Mismatches:
    """``history_mismatch`` answers to one turn: they persist once every replica gave one and the first
    is ``RECONCILE_AFTER_S`` old (or any is ``RECONCILE_ANY_S`` old, a replica never answering). Until
    then a replica holding turns Redis lacks (cut off from it) may still answer."""

    since: float | None = None
    urls: set[str] = field(default_factory=set)

    def persists(self, url: str, replicas: int) -> bool:
        now = time.monotonic()
        self.since = self.since or now
        self.urls.add(url)
        waited = now - self.since
        return (waited >= RECONCILE_AFTER_S and len(self.urls) >= replicas) or waited >= RECONCILE_ANY_S


def error_code(response: httpx.Response) -> str:
    try:
        code = response.json()["error"]["code"]
    except Exception:  # not our error body
        code = f"http_{response.status_code}"
    return KINDS.get(code, code)


def error_detail(response: httpx.Response, chars: int = 120) -> str:
    """The error's code and the start of its message: what a session's timeline shows of a failed attempt."""
    try:
        message = str(response.json()["error"].get("message", ""))[:chars]
    except Exception:  # not our error body
        message = ""
    return f"{error_code(response)}: {message}" if message else error_code(response)


def transport_kind(exc: httpx.TransportError) -> str:
    return "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
