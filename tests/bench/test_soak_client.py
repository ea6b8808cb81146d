"""A ``bench soak`` client against a fake replica (``httpx.MockTransport``): what it records of each turn's
save, and how it goes on after a turn that failed half-way stayed in the history, or after Redis lost
turns it had acknowledged (``session_diverged``)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.soak_client import Client
from bench.soak_log import Options, SessionLog, Tally


class FakeServer:
    """A replica as a soak client sees it (``httpx.MockTransport``): a session whose history is ``messages``;
    each turn answers with the next of ``answers`` (a status and a body), then appends what ran (the
    reply, ``kept``: also a turn answered with an error, as a turn that failed half-way stays)."""

    def __init__(self, messages, answers):
        self.messages, self.answers = messages, list(answers)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/export"):
            return httpx.Response(200, json={"messages": self.messages, "token_ids": [1, 2, 3]})
        status, body, kept = self.answers.pop(0)
        content = json.loads(request.content)["messages"][-1]["content"]
        if kept is not None:
            self.messages += [{"role": "user", "content": content}, {"role": "assistant", "content": kept,
                                                                     **({"error": True} if status != 200 else {})}]
        return httpx.Response(status, json=body, headers={"x-replica": "r0"})


def _client_turn(server: FakeServer, log: SessionLog) -> tuple[bool, Tally]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            client = Client(0, http, ["http://r0"], Options(model="m", move_prob=0), Tally(), seed=1)
            client._backoff = lambda attempt: asyncio.sleep(0)
            return await client.turn(log, time.monotonic() + 5), client.tally

    return asyncio.run(go())


def _answer(reply: str, durability: str = "replicated") -> tuple[int, dict, str]:
    storage = {"saved": durability != "none", "durable": durability == "replicated", "durability": durability}
    return 200, {"choices": [{"message": {"content": reply}}], "storage": storage}, reply


def test_a_client_records_what_each_save_gave_and_goes_on_after_a_failed_turn():
    log = SessionLog("s1", "t", 0)
    server = FakeServer([], [_answer("A", "memory")])
    ok, tally = _client_turn(server, log)
    assert ok and (log.turns[0].durability, log.turns[0].durable, log.turns[0].reply) == ("memory", False, "A")
    assert tally.acks == {"memory": 1} and log.turns[0].token_ids == [1, 2, 3]
    # The next turn is refused half-way: it stays in the history, flagged, and its retry is a mismatch.
    server.answers = [(429, {"error": {"code": "host_memory_exhausted"}}, "Th"),
                      (409, {"error": {"code": "history_mismatch"}}, None)]
    ok, tally = _client_turn(server, log)
    assert ok and [t.reply for t in log.turns] == ["A", "Th"] and log.turns[1].unfinished and log.in_doubt is None
    assert tally.reconciles == 1 and not log.lost and tally.turns_failed == {"host_memory_exhausted": 1,
                                                                              "history_mismatch": 1}
    assert log.conversation()[3] == {"role": "assistant", "content": "Th", "error": True}


def test_a_client_told_of_a_divergence_counts_what_it_lost():
    log = SessionLog("s1", "t", 0)
    server = FakeServer([], [_answer("A"), _answer("B", "memory")])
    _client_turn(server, log)
    _client_turn(server, log)
    server.messages = server.messages[:2]  # Redis lost turn 1 (acknowledged not durable); another went on
    server.answers = [(409, {"error": {"code": "session_diverged"}}, None)]
    ok, tally = _client_turn(server, log)
    assert ok and [t.reply for t in log.turns] == ["A"] and [t.reply for t in log.lost] == ["B"]
    assert (tally.diverged_told, tally.lost_not_durable, tally.lost_durable) == (1, 1, 0)
    assert log.begun == 3  # the next turn's message and key are new
