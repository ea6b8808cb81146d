"""Serving settings (HTTP, Ray Serve, session handling), kept apart from the engine's ``Settings``.

``ServeSettings`` is a mixin of extra ``RKV_`` fields; ``ServerSettings`` is what the serving
code reads: the engine settings and these together, from one environment.
"""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.settings import Settings


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RKV_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address the HTTP server listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server listens on.")
    served_model_name: str | None = Field(
        None, description="Model id shown by /v1/models and accepted in completions (default: derived from `model`)."
    )
    replica_id: str | None = Field(
        None, description="Name this process reports as its replica without Ray (default: local-<pid>)."
    )

    # Ray Serve
    ray_address: str | None = Field(
        None, description="Ray cluster to join ('auto' or an address); unset starts a local Ray instance."
    )
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started Ray instance.")
    ray_object_store_bytes: int = Field(
        256 * 1024**2, ge=78 * 1024**2, description="Object store size of a locally started Ray instance."
    )
    num_replicas: int = Field(1, ge=1, description="Chat replicas when autoscaling is off.")
    autoscaling: bool = Field(False, description="Let Ray Serve scale chat replicas between min and max.")
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound of chat replicas.")
    max_replicas: int = Field(4, ge=1, description="Autoscaling upper bound of chat replicas.")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="Autoscaling target of in-flight requests (turns) per chat replica."
    )
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per chat replica; unset means 1 when CUDA is visible, else 0."
    )
    replica_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per chat replica.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Concurrent requests one chat replica accepts (turns, cancels, lookups)."
    )
    ingress_max_ongoing_requests: int = Field(
        1000, ge=1, description="Concurrent requests of the HTTP ingress; each open WebSocket holds one."
    )
    max_sessions_per_replica: int = Field(
        1024,
        ge=1,
        description="Sessions a replica advertises to the router as held (least recently used drop out).",
    )
    request_retry_s: float = Field(
        20.0, ge=0, description="How long the ingress retries a request whose replica died before it answered."
    )

    # Sessions (Redis itself is configured by the engine's redis_url / redis_namespace / redis_ttl_s)
    idle_evict_s: float = Field(
        3600.0,
        ge=1,
        description="Idle time after which a replica drops a session from memory (only when Redis keeps it).",
    )


class ServerSettings(ServeSettings, Settings):
    """Engine and serving settings together, as the server and its replicas use them."""

    model_config = SettingsConfigDict(env_prefix="RKV_", extra="ignore")
