"""The composition root: the pieces of a server built and wired together.

``build_service`` makes a replica's ``ChatService`` (engine, session store, limits) from settings;
``build_local_app`` puts the FastAPI routes over it in this process (tests, ``serve --no-ray``);
``api.deployment`` puts the same routes over Ray Serve replicas that each hold one service. Either
way the routes are given a ``ServiceClient`` (``app.contract.service.SessionService``).
"""
from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

from app.model_registry import display_name
from app.settings import ServerSettings

if TYPE_CHECKING:  # the engine imports torch; building the CLI parser and the Ray ingress must stay light
    from app.chat_service import ChatService

log = logging.getLogger(__name__)


def served_model_name(settings: ServerSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return display_name(settings.model)


def build_service(settings: ServerSettings, replica: str | None = None, loaded=None) -> "ChatService":
    """A replica's service. With Redis, its session records and its engine's KV tier share the one
    connection the engine opens (``RedisClient``)."""
    from app.chat_service import ChatService, StoragePolicy
    from app.engine.engine import Engine
    from app.session_store import SessionStore

    engine = Engine(settings, loaded=loaded)
    store = (SessionStore.configured(engine.redis.client, settings, lambda: engine.store_config)
             if engine.redis is not None else None)
    return ChatService(
        engine,
        replica or settings.replica_id,
        store,
        settings.idle_evict_s,
        max_sessions=settings.max_sessions_per_replica,
        policy=StoragePolicy(settings.refuse_unsaved_turns, settings.quota_sessions, settings.quota_bytes),
    )


def build_local_app(settings: ServerSettings, loaded=None):
    """The app over an in-process engine (no Ray): tests and ``serve --no-ray``."""
    from api.routes import create_app
    from api.service_client import LocalTransport, ServiceClient

    service = build_service(settings, loaded=loaded)
    client = ServiceClient(LocalTransport(service), served_model_name(settings), service.replica, service.store)
    return with_stats_route(create_app(client, settings))


def with_stats_route(app):
    """Add ``GET /v1/stats``: the service's totals as JSON (sessions, bytes per tier, device budget,
    peak device bytes, parked sessions, refused turns, batching figures); ``bench serve`` reads it."""
    service = app.state.service

    @app.get("/v1/stats", tags=["ops"])
    async def stats():
        return await service.stats()

    return app


def freeze_long_lived() -> None:
    """Called once a serving process has built its replica: what exists then (the model's modules, the
    tokenizer, the engine: ~400k objects with the bundled model) lives as long as the process, so it
    leaves the collector's view. A full collection scanned all of it, ~0.2 s on a small CPU, inside
    whichever model step set it off: a pause every streaming session saw."""
    gc.collect()
    gc.freeze()


def run_local(settings: ServerSettings) -> int:
    import uvicorn

    app = build_local_app(settings)
    freeze_long_lived()
    log.warning("serving on http://%s:%d (in-process, no Ray)", settings.host, settings.port)
    # Frames over the limit are refused by the protocol layer (close 1009) before anyone buffers them.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", ws_ping_interval=30,
                ws_max_size=settings.max_request_bytes + 1024)
    return 0
