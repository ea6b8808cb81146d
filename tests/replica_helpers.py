"""Replicas in one process for service tests: each a ``ChatService`` on an engine of its own (the real
small model, ``tiered``), sharing one Redis namespace, as replicas of one deployment do."""
from __future__ import annotations

from app.chat_service import ChatService, StoragePolicy
from app.contract.events import Done
from app.contract.ids import new_session_id
from app.session_store import SessionStore

LONG = "The lighthouse keeper wrote about the storm, the gulls and the ships that passed by. " * 6


def replica(make_engine, url: str, ns: str, name: str, policy: StoragePolicy | None = None,
            **settings) -> ChatService:
    """A replica as the server makes one (``settings``: more of ``Settings``; ``policy``: the service's
    ``StoragePolicy``); its store leaves KV pending as long as its engine's tier does
    (``redis_pending_ttl_s``)."""
    engine = make_engine(**{"mode": "tiered", "token_budget": 32, "redis_url": url, "redis_namespace": ns,
                            "page_tokens": 8, **settings})
    store = SessionStore.configured(engine.redis.client, engine.settings, lambda: engine.store_config)
    return ChatService(engine, name, store, policy=policy)


async def events_of(service: ChatService, sid: str, token: str, text: str, key: str | None = None) -> list:
    """Every event of one turn (``max_tokens`` 4)."""
    return [e async for e in service.chat(sid, token, text, {"max_tokens": 4}, turn_key=key)]


async def turn(service: ChatService, sid: str, token: str, text: str) -> Done:
    """A turn that must finish: its ``Done``."""
    events = await events_of(service, sid, token, text)
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


async def new_session(service: ChatService) -> tuple[str, str]:
    """(id, token) of a ``tiered`` session made on ``service`` whose first turn (``LONG``) left cold pages."""
    sid = new_session_id()
    token = (await service.create_session(sid, mode="tiered"))["token"]
    await turn(service, sid, token, LONG)
    return sid, token
