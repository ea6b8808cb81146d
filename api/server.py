"""``rocketkv-mt serve``: the chat server on local Ray Serve, or in this process with ``--no-ray``.

Both run the same FastAPI routes (``api.routes.create_app``); only the backend differs.
"""
from __future__ import annotations

import argparse
import logging
import signal
import time
from typing import TYPE_CHECKING

from app.model_registry import display_name
from app.settings import ServerSettings

if TYPE_CHECKING:  # the engine imports torch; the CLI parser must stay light
    from app.chat_service import ChatService
    from app.session_store import SessionStore

log = logging.getLogger(__name__)
APP_NAME = "rocketkv-mt"


def served_model_name(settings: ServerSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return display_name(settings.model)


def make_store(settings: ServerSettings) -> "SessionStore | None":
    from app.session_store import SessionStore

    if not settings.redis_url:
        return None
    return SessionStore(settings.redis_url, settings.redis_namespace, settings.redis_ttl_s)


def build_service(settings: ServerSettings, replica: str | None = None, loaded=None) -> "ChatService":
    from app.chat_service import ChatService
    from app.engine.engine import Engine

    engine = Engine(settings, loaded=loaded)
    return ChatService(
        engine,
        replica or settings.replica_id,
        make_store(settings),
        settings.idle_evict_s,
        max_sessions=settings.max_sessions_per_replica,
    )


def build_local_app(settings: ServerSettings, loaded=None):
    """The app over an in-process engine (no Ray): tests and ``serve --no-ray``."""
    from api.backend import LocalBackend
    from api.routes import create_app

    app = create_app(LocalBackend(build_service(settings, loaded=loaded), served_model_name(settings)), settings)
    return with_stats_route(app)


def with_stats_route(app):
    """Add ``GET /v1/stats``: the backend's totals as JSON (sessions, bytes per tier, device budget,
    peak device bytes, parked sessions, refused turns, batching figures); ``bench serve`` reads it."""
    backend = app.state.backend

    @app.get("/v1/stats", tags=["ops"])
    async def stats():
        return await backend.stats()

    return app


def run_local(settings: ServerSettings) -> int:
    import uvicorn

    app = build_local_app(settings)
    log.warning("serving on http://%s:%d (in-process, no Ray)", settings.host, settings.port)
    # Frames over the limit are refused by the protocol layer (close 1009) before anyone buffers them.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", ws_ping_interval=30,
                ws_max_size=settings.max_request_bytes + 1024)
    return 0


def start_ray(settings: ServerSettings) -> None:
    import ray

    from app.deployment import WORKER_ENV

    if ray.is_initialized():
        return
    if settings.ray_address:
        ray.init(address=settings.ray_address, runtime_env={"env_vars": WORKER_ENV})
        return
    ray.init(
        num_cpus=settings.ray_num_cpus,
        include_dashboard=False,
        object_store_memory=settings.ray_object_store_bytes,
        runtime_env={"env_vars": WORKER_ENV},
        logging_level=logging.WARNING,
    )


def deploy(settings: ServerSettings):
    """Start Ray (if needed), the HTTP proxy and the application; returns the ingress handle."""
    from ray import serve

    from app.deployment import build_app

    start_ray(settings)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    return serve.run(build_app(settings), name=APP_NAME, route_prefix="/")


def run_ray(settings: ServerSettings) -> int:
    import ray
    from ray import serve

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        deploy(settings)
        log.warning("serving on http://%s:%d (Ray Serve)", settings.host, settings.port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = {
        "host": args.host,
        "port": args.port,
        "num_replicas": args.replicas,
        "redis_url": args.redis_url,
        "model": args.model,
        "mode": args.mode,
        "token_budget": args.budget,
        "device": args.device,
    }
    settings = ServerSettings(**{k: v for k, v in overrides.items() if v is not None})
    logging.getLogger("app").setLevel(logging.INFO)
    return run_local(settings) if args.no_ray else run_ray(settings)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the chat server (Ray Serve, or in-process with --no-ray)")
    p.add_argument("--host", help="listen address (default 127.0.0.1, env RKV_HOST)")
    p.add_argument("--port", type=int, help="listen port (default 8000, env RKV_PORT)")
    p.add_argument("--replicas", type=int, help="chat replicas (env RKV_NUM_REPLICAS)")
    p.add_argument("--no-ray", action="store_true", help="serve from this process without Ray")
    p.add_argument("--redis-url", help="Redis for session restore (env RKV_REDIS_URL)")
    p.add_argument("--model", help="model id or path (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--mode", help="default cache mode of new sessions")
    p.add_argument("--budget", type=int, help="default RocketKV token budget")
    p.add_argument("--device", help="cpu, cuda, auto")
    p.set_defaults(func=cmd_serve)
