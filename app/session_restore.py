"""Sessions to and from plain data: store records, exports, sessions seeded from a history, and the
checks of what a client sends (messages, sampling values).

A session is rebuilt here from its public fields with ``cache=None`` and handed to the engine
(``Engine.adopt``), after every field has been checked (nothing is made and thrown away to
validate). Its next turn restores the cache from the KV generation the record's ``kv`` names
(``tiers.session_kv``) when there is one and it is whole; where its pages are gone it rebuilds the
very same cache by replaying the record's ``feeds`` (``app.engine.replay``), and otherwise prefills
the whole ``token_ids`` into a fresh cache. Nothing here touches tensors.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from app.engine.engine import Engine
from app.engine.errors import InvalidRequest, InvalidSamplingParams, MessageTooLarge
from app.engine.replay import replayable
from app.engine.sampling import SamplingParams
from app.engine.session import Feed, Session, TurnStats
from rocketkv_mt.config import RocketKVConfig

ROLES = ("system", "user", "assistant")
SAMPLING_FLOOR = 1e-6
MAX_SEED = 2**63 - 1
# Flags the engine keeps on messages; everything else a client sends along is dropped.
_MESSAGE_FLAGS = ("closed", "cancelled", "error")


def is_unicode(text: str) -> bool:
    """False for strings with lone surrogates, which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def checked_sampling(sampling: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """``SamplingParams`` of a request's values over the server's ``defaults`` (what it leaves out), plus
    the bounds the sampler itself needs (found by fuzzing: smaller values become 0 in float32, or push
    the logits to inf, and the turn fails)."""
    given = {k: v for k, v in (sampling or {}).items() if v is not None}
    params = SamplingParams.parse(**{**(defaults or {}), **given})
    if 0 < params.temperature < SAMPLING_FLOOR or params.top_p < SAMPLING_FLOOR:
        raise InvalidSamplingParams(f"temperature (when not 0) and top_p must be at least {SAMPLING_FLOOR:g}")
    if params.seed is not None and params.seed > MAX_SEED:
        raise InvalidSamplingParams(f"seed must be at most {MAX_SEED} (torch seeds are 64-bit)")
    return params


def clean_messages(messages: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}] needs a role in {ROLES} and a string content")
        if not is_unicode(m["content"]):
            raise InvalidRequest(f"messages[{i}] is not valid Unicode text (a lone surrogate)")
        out.append({"role": m["role"], "content": m["content"], **{k: True for k in _MESSAGE_FLAGS if m.get(k)}})
    return out


def render_ids(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a finished history, as if every turn had been closed by the chat template.

    A history without any reply stays unrendered: the engine renders it, with the next user
    message, as a first turn.
    """
    if not any(m["role"] == "assistant" for m in messages):
        return []
    return engine.chat_format.encode(engine.chat_format.render(messages))


def check_ids(engine: Engine, token_ids: list[Any]) -> list[int]:
    vocab = int(getattr(engine.loaded.model.config, "vocab_size", 0) or len(engine.tokenizer))
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
        raise InvalidRequest(f"token_ids must be integers in [0, {vocab})")
    if len(token_ids) >= engine.max_context:
        raise InvalidRequest(f"the session has {len(token_ids)} tokens; the model context is {engine.max_context}")
    return list(token_ids)


def check_new(engine: Engine, session_id: str, system: str | None) -> None:
    """What ``create_with_id`` refuses before anything is made: an id in use, a bad system prompt."""
    if session_id in engine.sessions:
        raise InvalidRequest("session id already in use")
    limit = engine.settings.max_message_bytes
    if system is not None and len(system.encode("utf-8", "surrogatepass")) > limit:
        raise MessageTooLarge(f"the system prompt is over {limit} bytes")
    if system is not None and not is_unicode(system):
        raise InvalidRequest("the system prompt is not valid Unicode text (a lone surrogate)")


def create_with_id(
    engine: Engine,
    session_id: str,
    mode: str | None,
    budget: int | None,
    system: str | None,
    owner: str | None = None,
) -> Session:
    """A new session under an id chosen by the caller (the router keys on it).

    Its cache is made by the engine at the first turn, so that the cache's tier keys carry this id.
    """
    mode, rocket = engine.session_config(mode, budget)
    session = Session(id=session_id, mode=mode, rocket=rocket, cache=None, owner=owner)
    if system:
        session.messages.append({"role": "system", "content": system})
    return engine.adopt(session)


def seed_session(
    engine: Engine,
    session_id: str,
    *,
    mode: str | None,
    budget: int | None,
    messages: list[Any],
    token_ids: list[Any] | None = None,
    rocket: dict[str, Any] | None = None,
    turns: list[dict[str, Any]] | None = None,
    created_at: float | None = None,
    owner: str | None = None,
) -> Session:
    """A session holding ``messages`` whose cache is rebuilt from ``token_ids`` on its next turn."""
    msgs = clean_messages(messages)
    mode, config = engine.session_config(mode, budget)
    if rocket:
        config = RocketKVConfig.model_validate(rocket)
    ids = check_ids(engine, token_ids) if token_ids is not None else render_ids(engine, msgs)
    if ids and msgs and token_ids is None:
        msgs[-1]["closed"] = True  # the rendering already closed the last turn
    session = Session(
        id=session_id, mode=mode, rocket=config, cache=None, messages=msgs, token_ids=ids, owner=owner
    )
    session.turns = [TurnStats(**t) for t in turns or []]
    if created_at:
        session.created_at = created_at
    return engine.adopt(session)


def budget_of(session: Session) -> int:
    return session.rocket.token_budget


def summary(session: Session, replica: str | None) -> dict[str, Any]:
    return {
        "session_id": session.id,
        "mode": session.mode,
        "budget": budget_of(session),
        "turns": len(session.turns),
        "history_tokens": len(session.token_ids),
        "created_at": session.created_at,
        "last_used": session.last_used,
        "replica": replica,
        "owner": session.owner,  # for filtering listings; the API never shows it
    }


def info(session: Session, token: str | None, replica: str, restored: bool = False,
         sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """A session as its creator or resumer is told: id, token, mode, budget, where it is, and what a turn
    that sends no sampling values of its own is drawn with (``sampling``: the server's defaults)."""
    return {
        "sampling": sampling,
        "session_id": session.id,
        "token": token,
        "mode": session.mode,
        "budget": budget_of(session),
        "replica": replica,
        "restored": restored,
    }


def detail(session: Session, replica: str | None, memory: dict[str, Any]) -> dict[str, Any]:
    """A session as ``GET /v1/sessions/{id}`` shows it: summary, messages, token counts, memory, turns."""
    cache = session.cache
    return {
        **summary(session, replica),
        "messages": session.messages,
        "tokens": {
            "history": len(session.token_ids),
            "cached": session.fed_tokens,
            "device": cache.kept_tokens() if cache is not None else 0,
        },
        "memory": memory,
        "turn_stats": [
            {k: getattr(t, k) for k in ("prompt_tokens", "prefilled_tokens", "generated_tokens",
                                         "finish_reason", "ttft_ms", "latency_ms")}
            for t in session.turns
        ],
        "busy": session.busy,
    }


def record(session: Session, digest: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    """Everything needed to restore the session elsewhere (the store's ``data``); ``kv`` is what
    ``Engine.persist`` wrote for it just before."""
    return {
        "id": session.id,
        "mode": session.mode,
        "rocket": session.rocket.model_dump(),
        "messages": session.messages,
        "token_ids": session.token_ids,
        "token_sha256": digest,
        "owner": session.owner,
        "turns": [dataclasses.asdict(t) for t in session.turns],
        "created_at": session.created_at,
        "saved_at": time.time(),
        "last_turn": session.last_turn,
        "kv": kv,
        # How the cache was fed, turn by turn ([prefill, max_new, decodes]): another process replays it
        # where pages ``kv`` names are lost, or where its KV could not be written (``fed``: what it had
        # been fed then), so that the rebuilt cache, and the replies, are the ones this cache gives.
        "feeds": [[f.prefill, f.max_new, f.decodes] for f in session.feeds],
        "fed": (session.fed_tokens or session.lost_fed) if kv is None and (session.kv_unwritten or session.lost_fed)
        else None,
    }


def checked_feeds(engine: Engine, feeds: Any, fed: Any, token_ids: list[int]) -> list[Feed]:
    """A record's feed log where it describes the cache the record stands for, which had been fed
    ``fed`` tokens: [prefill, max_new, decodes] integers as turns feed them, accounting for exactly
    those, a part of the history. Anything else (malformed, another cache's log, a record from before
    logs were kept, nothing fed) is no log: a rebuild then prefills the history in one go, as it would
    without one."""
    if not isinstance(feeds, list):
        return []
    parsed: list[Feed] = []
    for entry in feeds:
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(v) is int for v in entry)):
            return []
        prefill, max_new, decodes = entry
        if not (0 < prefill and 0 <= decodes < max_new <= engine.max_context):
            return []
        parsed.append(Feed(prefill, max_new, decodes))
    if type(fed) is not int or fed > len(token_ids) or not replayable(parsed, fed):
        return []
    return parsed


def restore(engine: Engine, data: dict[str, Any]) -> Session:
    """The session of a stored record, held by ``engine``; its KV comes back at its next turn."""
    kv, last_turn = data.get("kv"), data.get("last_turn")
    if not isinstance(kv, (dict, type(None))) or not isinstance(last_turn, (dict, type(None))):
        raise InvalidRequest("the stored record is not one this server wrote")
    session = seed_session(
        engine,
        data["id"],
        mode=data["mode"],
        budget=None,
        messages=data["messages"],
        token_ids=data["token_ids"],
        rocket=data.get("rocket"),
        turns=data.get("turns"),
        created_at=data.get("created_at"),
        owner=data.get("owner"),
    )
    session.parked_kv, session.last_turn = kv, last_turn
    fed = kv.get("history_len") if isinstance(kv, dict) else data.get("fed")
    session.feeds = checked_feeds(engine, data.get("feeds"), fed, session.token_ids)
    if kv is None and session.feeds:
        session.lost_fed = fed  # its KV was never written: the next turn rebuilds the cache by replay
    return session


def export(session: Session) -> dict[str, Any]:
    return {
        "format": "rocketkv-mt.session/1",
        "session_id": session.id,
        "mode": session.mode,
        "budget": budget_of(session),
        "messages": session.messages,
        "token_ids": session.token_ids,
    }
