"""A session's memory map as the service hands it out: the cache's map (``rocketkv_mt.cache.memory_map``)
with the conversation's message spans and, on request, each position's token text; and the map's
summary that every ``done`` event carries.

A session without a cache on the device (parked, or restored and not used since) has a map too:
a ``tiered`` cache parked with its KV in Redis is all ``redis``; any other is ``unfed`` (its next
turn prefills the history again).
"""
from __future__ import annotations

from typing import Any

from app.contract.events import MapSummary
from app.engine.engine import Engine
from app.engine.session import Session
from rocketkv_mt.cache.memory_map import MemoryMap, parked_map, parked_summary


def cache_map(engine: Engine, session: Session, positions: int) -> MemoryMap:
    """The map of the session's ``positions`` tokens, from its cache, or as its parked record leaves it."""
    cache = session.cache
    if cache is not None:
        return cache.memory_map(positions)
    spec, parked = engine.runner.spec, session.parked_kv
    fed = int(parked.get("history_len", 0)) if parked else 0
    return parked_map(spec.num_layers, spec.num_kv_heads, fed, positions, in_redis=parked is not None)


def map_summary(engine: Engine, session: Session) -> MapSummary:
    """The summary a ``done`` event carries (the turn is settled when it is made), counted from the
    cache's bookkeeping without building the map: a long history costs no more than its cold pages."""
    cache, positions = session.cache, len(session.token_ids)
    if cache is not None:
        return MapSummary(**cache.map_summary(positions))
    spec, parked = engine.runner.spec, session.parked_kv
    fed = int(parked.get("history_len", 0)) if parked else 0
    return MapSummary(**parked_summary(spec.num_layers, spec.num_kv_heads, fed, positions, parked is not None))


def message_spans(session: Session) -> list[dict[str, Any]]:
    """Where each message's tokens are, [start, end) positions, from the turns' figures: a turn's user
    span runs from the end of the reply before it (the template's text between them included) to its
    prompt's end, its reply's span over the tokens it generated. What came in by an import, without
    turn figures, is one ``history`` span (the first turn's user message included)."""
    n = len(session.token_ids)
    replies = [i for i, m in enumerate(session.messages) if m["role"] == "assistant"]
    paired = min(len(replies), len(session.turns))
    imported = len(replies) > paired
    turns, replies = session.turns[len(session.turns) - paired:], replies[len(replies) - paired:]
    if not turns:
        return [{"role": "history", "message": None, "start": 0, "end": n}] if n else []
    spans: list[dict[str, Any]] = []
    start = 0
    for turn, reply in zip(turns, replies):
        prompt = min(turn.prompt_tokens, n)
        generated = 0 if turn.finish_reason == "error" else turn.generated_tokens
        end = min(prompt + generated, n)
        if imported and not spans:
            spans.append({"role": "history", "message": None, "start": start, "end": prompt})
        else:
            spans.append({"role": "user", "message": reply - 1, "start": start, "end": prompt})
        spans.append({"role": "assistant", "message": reply, "start": prompt, "end": end})
        start = end
    return [s for s in spans if s["end"] > s["start"]]


async def session_map(engine: Engine, session: Session, text: bool = False) -> dict[str, Any]:
    """The map's wire form (``MemoryMap.encode``) for the session, with ``messages`` (``message_spans``)
    and, with ``text``, ``tokens``: each position's token decoded alone. Built on the model thread,
    between steps, so a turn under way is seen between two of its steps, never inside one."""
    ids = list(session.token_ids)
    mm = await engine.batcher.run(lambda: cache_map(engine, session, len(ids)))
    out = {"session_id": session.id, "mode": session.mode, "held": session.cache is not None, **mm.encode(),
           "messages": message_spans(session)}
    if text:
        out["tokens"] = engine.tokenizer.batch_decode([[i] for i in ids]) if ids else []
    return out
