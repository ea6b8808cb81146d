"""``rocketkv-mt serve``: the chat server on local Ray Serve, or in this process with ``--no-ray``.

Both run the same FastAPI routes (``api.routes.create_app``); only the backend differs.
"""
from __future__ import annotations

import argparse
import logging

from app.settings import ServerSettings


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
    logging.getLogger("api").setLevel(logging.INFO)
    if args.no_ray:
        from api.server import run_local

        return run_local(settings)
    from api.deployment import run_ray  # Ray is imported only when it is used

    return run_ray(settings)


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
