"""Ray Serve application: an HTTP ingress (FastAPI) in front of chat replicas.

``ChatReplica`` runs an ``Engine`` inside a ``ChatService``; the ingress's ``ServiceClient``
reaches it through a ``RayTransport`` whose requests ``SessionAffinityRouter`` pins to the
session's replica. Each
replica registers the sessions it serves with ``@serve.multiplexed`` (the router prefers a
replica that holds the session) and reports its room for new sessions (``record_routing_stats``,
``app.placement``); both are only routing data, the sessions themselves live in the service.
``deploy`` / ``run_ray`` start Ray (or join ``RKV_RAY_ADDRESS``), its HTTP proxy and the application
(``rocketkv-mt serve``); ``app_builder`` is the same application for a Serve config file (``serve
deploy``, KubeRay's ``RayService``: deploy/kuberay/rayservice.yaml).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from api.server import build_service, freeze_long_lived, served_model_name, with_stats_route
from app.contract.events import TurnStarted
from app.contract.service import HOLDING_VERBS, VERBS, outcome
from app.settings import ServerSettings

# Read at import because the decorator needs it at class creation (replicas inherit the env).
MAX_HELD = int(os.environ.get("RKV_MAX_SESSIONS_PER_REPLICA", "1024"))
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# How often replicas report their room to the routers: a burst of new sessions between two reports is
# spread by the router's own count (``app.placement.Placer``), so seconds are enough.
ROUTING_STATS_S = 2.0
APP_NAME = "rocketkv-mt"
# A resource only the head node has (Ray's own name for it). The ingress holds every client's
# WebSocket: on the head, which the cluster cannot lose anyway, a worker's death drops no connection.
HEAD_NODE_RESOURCE = "node:__internal_head__"
# One HTTP proxy, on the head beside the ingress: a proxy on a worker would only forward to it.
PROXY_LOCATION = "HeadOnly"
log = logging.getLogger(__name__)


def replica_name() -> str:
    replica_id = serve.get_replica_context().replica_id
    return getattr(replica_id, "unique_id", None) or str(replica_id)


class ChatReplica:
    def __init__(self, settings: dict[str, Any]):
        for key, value in WORKER_ENV.items():
            os.environ.setdefault(key, value)
        self.service = build_service(ServerSettings(**settings), replica_name())
        freeze_long_lived()  # a replica is a process of its own

    async def check_health(self) -> None:
        # Serve calls this periodically from the replica's loop: a replica that has not served
        # anything yet still starts housekeeping (and reports its stats).
        self.service.start()

    async def record_routing_stats(self) -> dict[str, Any]:
        # Serve polls this every ROUTING_STATS_S and hands it to the routers (``api.ray_router``).
        return self.service.routing_stats()

    @serve.multiplexed(max_num_models_per_replica=MAX_HELD)
    async def _hold(self, session_id: str) -> str:
        return session_id

    async def call(self, verb: str, *args) -> dict[str, Any]:
        """One unary verb of the service (``app.contract.service.VERBS``), its result as ``outcome`` data."""
        if verb not in VERBS:
            raise ValueError(f"{verb!r} is not a session verb")
        self.service.start()
        result = await outcome(getattr(self.service, verb)(*args))
        if "ok" in result and verb in HOLDING_VERBS:
            await self._hold(args[0])
        return result

    async def chat(self, sid, *args):
        async for event in self.service.chat(sid, *args):
            if event.type == TurnStarted.type:
                await self._hold(sid)
            yield event


@serve.ingress()
class Ingress:
    def __init__(self, chat: Any, settings: dict[str, Any]):
        from api.ray_transport import RayTransport
        from api.service_client import ServiceClient
        from app.session_store import SessionStore

        config = ServerSettings(**settings)
        self.settings = config
        store = SessionStore.connect(config.redis_url, config.redis_namespace, config.redis_ttl_s) if config.redis_url else None
        self.service = ServiceClient(RayTransport(chat), served_model_name(config), f"ingress-{replica_name()}",
                                     store, retry_s=config.request_retry_s)

    def __serve_build_asgi_app__(self):
        from api.routes import create_app

        return with_stats_route(create_app(self.service, self.settings))


def gpus_per_replica(settings: ServerSettings) -> float:
    if settings.num_gpus is not None:
        return settings.num_gpus
    import torch

    return 1.0 if settings.device != "cpu" and torch.cuda.is_available() else 0.0


def build_app(settings: ServerSettings):
    """The bound application: ``serve.run(build_app(settings))``."""
    config = settings.model_dump(mode="json")
    scaling: dict[str, Any] = (
        {
            "autoscaling_config": {
                "min_replicas": settings.min_replicas,
                "max_replicas": settings.max_replicas,
                "target_ongoing_requests": settings.target_ongoing_requests,
            }
        }
        if settings.autoscaling
        else {"num_replicas": settings.num_replicas}
    )
    chat = serve.deployment(ChatReplica).options(
        name="ChatReplica",
        ray_actor_options={
            "num_cpus": settings.replica_num_cpus,
            "num_gpus": gpus_per_replica(settings),
            "resources": dict(settings.replica_resources),
            "runtime_env": {
                "env_vars": {**WORKER_ENV, "RKV_MAX_SESSIONS_PER_REPLICA": str(settings.max_sessions_per_replica)}
            },
        },
        max_ongoing_requests=settings.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="api.ray_router.SessionAffinityRouter",
            request_router_kwargs={"policy": settings.placement},
            request_routing_stats_period_s=ROUTING_STATS_S,
        ),
        **scaling,
    )
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=settings.ingress_max_ongoing_requests,
    )
    # Only the ingress checks API keys; chat replicas never see them.
    replica_config = {k: v for k, v in config.items() if k != "api_key"}
    return ingress.bind(chat.bind(replica_config), config)


def app_builder(args: dict[str, Any]):
    """The application as a Serve config names it (``import_path: api.deployment:app_builder``): ``args``
    are settings by field name, over the ``RKV_`` environment of the node that builds it."""
    return build_app(ServerSettings(**args))


def start_ray(settings: ServerSettings) -> None:
    import ray

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
    start_ray(settings)
    serve.start(proxy_location=PROXY_LOCATION, http_options={"host": settings.host, "port": settings.port})
    return serve.run(build_app(settings), name=APP_NAME, route_prefix="/")


def run_ray(settings: ServerSettings) -> int:
    import ray

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
