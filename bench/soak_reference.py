"""The reference run of ``bench soak``: every surviving session's final conversation replayed turn by turn
on one fresh replica with a private Redis and no fault, its replies against the soak's (greedy decoding).

A KV restore is bit-exact and a rebuild replays the same feeds, so a session's replies depend on its
conversation only, up to the float noise of batched steps (the rows beside a session's change the order
its sums are taken in): a reply that differs is teacher-forced on the soak's own transcript
(``bench.soak_forced``), and it is a violation (served from wrong KV: another session's, a stale
generation's, a page restored short) unless every token the soak chose was within a tie of the top. Each session's user messages are sent in order in one reference session, so every turn
meets the same history, compression and spills included, as in the soak; up to its first turn that did
not finish (failed half-way, its partial reply kept in the history flagged ``error``), which no reference
can repeat.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from app.engine.engine import Engine
from app.settings import Settings
from bench.common import GREEDY
from bench.soak_checks import pairs, unfinished
from bench.soak_forced import MARGIN, Transcript, gaps
from bench.soak_procs import ReplicaProcess
from bench.soak_redis import SingleTopology

EXAMPLES = 10
CONCURRENT = 4  # sessions replayed at once (their turns batch, as in the soak)
RETRY_STATUS = (409, 429, 503)  # busy, or no room for now: sent again
ATTEMPTS = 10


def comparable(messages: list[dict]) -> list[tuple[str, str | None]]:
    """A history's (message, reply) pairs up to its first unfinished turn (``unfinished``): that turn's reply
    was cut short and its ids hold none, which no reference run can repeat, nor so the turns after it."""
    turns, cut = pairs(messages), unfinished(messages)
    return turns[: cut[0]] if cut else turns


def compare_replies(finals: dict[str, list[dict]], reference: dict[str, list[str]]) -> dict[str, Any]:
    """Each session's replies in the soak (``finals``: its history's messages) against the reference run's
    (``reference``: its replies in order, shorter where that run failed part way), up to the session's first
    unfinished turn (``cut_short`` counts the sessions that have one). The first differing turn of a session
    is its violation (the turns after it met another history); a session the reference could not replay as
    far as that is ``incomplete``, not a violation."""
    differ: list[dict[str, Any]] = []
    incomplete: list[str] = []
    turns = cut_short = 0
    for sid, messages in finals.items():
        conversation, replies = comparable(messages), reference.get(sid, [])
        cut_short += len(conversation) < len(pairs(messages))
        for i, ((_, soak), ref) in enumerate(zip(conversation, replies)):
            turns += 1
            if soak != ref:
                differ.append({"session": sid, "turn": i, "soak": soak, "reference": ref})
                break
        else:
            if len(replies) < len(conversation):
                incomplete.append(sid)
    return {"sessions": len(finals), "turns": turns, "differ": len(differ), "incomplete": len(incomplete),
            "cut_short": cut_short, "examples": differ[:EXAMPLES], "incomplete_examples": incomplete[:EXAMPLES]}


async def _post(http: httpx.AsyncClient, url: str, **kw) -> httpx.Response | None:
    """A POST, sent again while refused for room (``RETRY_STATUS``); None where it never got through."""
    for attempt in range(ATTEMPTS):
        try:
            r = await http.post(url, **kw)
        except httpx.HTTPError:
            return None
        if r.status_code not in RETRY_STATUS:
            return r
        await asyncio.sleep(0.5 * (attempt + 1))
    return None


async def replay(http: httpx.AsyncClient, url: str, model: str, max_tokens: int, mode: str,
                 conversation: list[tuple[str, str | None]]) -> list[str]:
    """The reference's replies to ``conversation``'s messages, one session, in order (fewer on a failure)."""
    r = await _post(http, f"{url}/v1/sessions", json={"mode": mode})
    if r is None or r.status_code != 201:
        return []
    info = r.json()
    headers = {"x-session-id": info["session_id"], "x-session-token": info["token"]}
    history: list[dict[str, str]] = []
    replies: list[str] = []
    for content, _ in conversation:
        history.append({"role": "user", "content": content})
        body = {"model": model, "messages": history, "max_tokens": max_tokens, **GREEDY}
        r = await _post(http, f"{url}/v1/chat/completions", json=body, headers=headers)
        if r is None or r.status_code != 200:
            break
        replies.append(r.json()["choices"][0]["message"]["content"])
        history.append({"role": "assistant", "content": replies[-1]})
    return replies


def settle_ties(result: dict[str, Any], transcripts: dict[str, Transcript], env: dict[str, str],
                max_tokens: int, mode: str) -> dict[str, Any]:
    """Each differing session teacher-forced on its own transcript (``bench.soak_forced``): where every token
    the soak chose up to the differing turn is within ``MARGIN`` of the reference's top logit, the
    difference is a tie float noise flipped (``ties``, not a violation); otherwise it stays one, with its
    widest gap. A session without a transcript stays a difference."""
    if not result["examples"]:
        return result
    engine = Engine(Settings(**{**settings_of(env), "host_tier_bytes": 1 << 32}))
    try:
        ties, kept = [], []
        for example in result["examples"]:
            transcript = transcripts.get(example["session"])
            found = gaps(engine, mode, transcript, example["turn"], max_tokens) if transcript else None
            example["widest_gap"] = max(found, default=0.0) if found is not None else None
            (ties if found is not None and example["widest_gap"] <= MARGIN else kept).append(example)
    finally:
        engine.close()
    return {**result, "differ": result["differ"] - len(ties), "examples": kept, "ties": len(ties),
            "tie_examples": ties}


def settings_of(env: dict[str, str]) -> dict[str, str]:
    """The engine settings a replica's ``RKV_`` environment names (Redis aside: the check keeps no KV there)."""
    return {k[4:].lower(): v for k, v in env.items() if k.startswith("RKV_") and not k.startswith("RKV_REDIS")
            and k != "RKV_REPLICA_ID"}


def client_transcript(log) -> Transcript | None:
    """A session's transcript as its client was acknowledged it (a deleted session: no server holds it)."""
    if not log.turns or log.turns[-1].token_ids is None or any(t.usage is None for t in log.turns):
        return None
    return Transcript(list(log.turns[-1].token_ids), [(p, p + n) for p, n in (t.usage for t in log.turns)])


async def reference_run(finals: dict[str, list[dict]], env: dict[str, str], dir: Path, max_tokens: int, mode: str,
                        timeout: float, transcripts: dict[str, Transcript] | None = None) -> dict[str, Any]:
    """Replay ``finals`` (each session's final messages) on a fresh replica with ``env`` over a private
    Redis under ``dir``; the comparison (``compare_replies``), its differences teacher-forced on the soak's
    own ``transcripts`` (``settle_ties``)."""
    conversations = {sid: comparable(messages) for sid, messages in finals.items()}
    with SingleTopology(dir / "redis") as redis:
        replica = ReplicaProcess("reference", {**env, "RKV_REDIS_URL": redis.url, "RKV_REDIS_NAMESPACE": "reference"},
                                 dir / "reference.log")
        try:
            await asyncio.to_thread(replica.spawn)
            await asyncio.to_thread(replica.wait_healthy)
            async with httpx.AsyncClient(timeout=timeout) as http:
                model = (await http.get(f"{replica.url}/v1/models")).json()["data"][0]["id"]
                gate = asyncio.Semaphore(CONCURRENT)

                async def one(conversation):
                    async with gate:
                        return await replay(http, replica.url, model, max_tokens, mode, conversation)

                done = await asyncio.gather(*(one(c) for c in conversations.values()))
        finally:
            await asyncio.to_thread(replica.stop)
    reference = dict(zip(conversations, done))
    # Kept beside the run's logs: what was replayed and answered, to replay a differing session by hand.
    (dir / "conversations.json").write_text(json.dumps({"soak": finals, "reference": reference}, indent=1))
    compared = compare_replies(finals, reference)
    return await asyncio.to_thread(settle_ties, compared, transcripts or {}, env, max_tokens, mode)
