"""All configuration in one place: environment variables with the ``RKV_`` prefix.

``Settings`` is what the engine reads; ``ServeSettings`` adds HTTP, Ray Serve and session
handling; ``ServerSettings`` is both, as the server and its replicas use them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tiers.store.redis.url import is_cluster, is_sentinel, parse_cluster, parse_sentinel

# The names of ``rocketkv_mt.cache.CACHE_MODES`` (a test keeps them equal), spelled out so that reading
# the settings imports no torch.
CacheMode = Literal["full", "snapkv", "rocketkv", "rocketkv-mt", "tiered"]
BUNDLED_MODEL = "bundled:smollm2-135m"  # installed by `make setup`: evals, benchmarks and tests load it
SERVED_MODEL = "bundled:qwen2.5-coder-0.5b"  # what a server chats with unless told otherwise


def _digits_as_int(value):
    """An environment variable's digits as the number they spell: a Literal of numbers takes no string."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


SketchBits = Annotated[Literal[0, 2, 4], BeforeValidator(_digits_as_int)]


def _checked_redis_url(value: str | None) -> str | None:
    """A Redis Cluster or Sentinel URL's nodes are read now: a wrong one fails at startup, not at the first save."""
    if value and is_cluster(value):
        parse_cluster(value)
    if value and is_sentinel(value):
        parse_sentinel(value)
    return value


RedisUrl = Annotated[str | None, AfterValidator(_checked_redis_url)]


class Settings(BaseSettings):
    """Server and engine settings. Every field reads ``RKV_<NAME>`` from the environment."""

    model_config = SettingsConfigDict(env_prefix="RKV_", extra="ignore")

    model: str = Field(
        BUNDLED_MODEL,
        description="Model to serve: the bundled SmolLM2-135M-Instruct, another bundled model "
        "(`bundled:qwen2.5-coder-0.5b` once `rocketkv-mt model fetch qwen2.5-coder-0.5b` has run; "
        "app/model_registry.py), a Hugging Face id, or a local path.",
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name inside `model` when it is a GGUF repository or folder."
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "rocketkv-mt",
        description="Where converted model weights (safetensors) are kept between starts.",
    )
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; 'auto' is bfloat16 on CUDA and float32 on CPU."
    )
    mode: CacheMode = Field("tiered", description="Default KV cache mode of new sessions.")
    token_budget: int = Field(
        256, ge=16, description="RocketKV token budget t; the other compression sizes derive from it."
    )
    window_size: int = Field(32, ge=1, description="Stage-1 observation window W (queries that score the history).")
    kernel_size: int = Field(
        15,
        ge=1,
        description="Stage-1 max-pool kernel over the scores (odd). The paper uses 63; 15 kept more of what the "
        "bundled 135M model needs at budget 256 (docs/design.md, Stage 1).",
    )
    max_new_tokens: int = Field(256, ge=1, description="Default cap on generated tokens per turn.")
    max_tokens_limit: int = Field(
        4096, ge=1, description="Largest max_tokens a request may ask for."
    )
    # A turn's sampling where its request leaves a value out (app/engine/sampling_defaults.py): these when
    # set, else the served model's generation config, else chat defaults. The engine's own callers (evals,
    # benchmarks) pass their values and stay greedy.
    default_temperature: float | None = Field(None, description="Temperature of requests that send none.")
    default_top_p: float | None = Field(None, description="top_p of requests that send none.")
    default_top_k: int | None = Field(None, description="top_k of requests that send none (0: off).")
    default_min_p: float | None = Field(None, description="min_p of requests that send none.")
    default_repetition_penalty: float | None = Field(None, description="repetition_penalty of requests that send none.")
    default_frequency_penalty: float | None = Field(None, description="frequency_penalty of requests that send none.")
    default_presence_penalty: float | None = Field(None, description="presence_penalty of requests that send none.")
    max_context: int | None = Field(
        None, ge=64, description="History limit in tokens; defaults to the model's maximum positions."
    )
    max_message_bytes: int = Field(256 * 1024, ge=1, description="Largest accepted user message, in UTF-8 bytes.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (default: torch's own).")
    cpu_linear: Literal["onednn", "torch"] = Field(
        "onednn",
        description="A float32 model's linear layers on CPU: 'onednn' packs their weights once at load for oneDNN's "
        "product (2-2.7x MKL's speed from 2 rows up on this project's AVX-512 CPU, where MKL took a narrower path; a row's result "
        "does not depend on the rows beside it); 'torch' keeps nn.Linear.",
    )
    flush_denormal: bool = Field(
        True,
        description="CPU: the engine's model thread and page reader treat subnormal floats (below 1.2e-38) as "
        "zero. A softmax over a long history makes many such weights, and x86 CPUs take a slow path on each "
        "(a tiered turn's prefill about 4% faster with them flushed, measured here).",
    )
    redis_url: RedisUrl = Field(
        None, description="Redis URL (e.g. redis://127.0.0.1:6379/0): cold KV spills there and sessions persist. "
        "A Redis Cluster: redis+cluster://host:port[,host:port...] (any of its nodes; rediss+cluster for TLS). "
        "A primary behind Redis Sentinel: redis+sentinel://host:port[,host:port...]/<service>[/<db>]."
    )
    redis_namespace: str = Field("rkv", description="Prefix of every Redis key this server writes.")
    redis_ttl_s: int = Field(7 * 86400, ge=60, description="Idle time after which a session's Redis keys expire.")
    redis_timeout_s: float = Field(
        2.0, gt=0, description="Socket timeout of each Redis operation; a Redis that does not answer costs this "
        "once, then its circuit opens."
    )
    redis_retry_s: float = Field(
        1.0, gt=0, description="After Redis failed, calls to it fail at once for this long before one probes "
        "again (doubling while probes fail, up to 30 times this); /healthz reports `degraded` meanwhile."
    )
    redis_pending_ttl_s: int = Field(
        600, ge=10, description="Lifetime of KV that no session record names yet (pages spilled or written by a "
        "turn whose record is not saved): renewed by its replica while it holds the session, so what a crashed "
        "or cut-off replica wrote is gone this long after it stopped renewing."
    )
    redis_min_replicas: int = Field(
        0, ge=0, description="Redis replicas a session's save waits for (`WAIT`) before a turn's `done` calls it "
        "durable; 0: no wait (durable only with `appendfsync always`)."
    )
    redis_wait_timeout_s: float = Field(
        1.0, gt=0, description="Longest a save waits for `RKV_REDIS_MIN_REPLICAS` replicas; past it the turn is "
        "saved but not durable."
    )
    redis_allow_eviction: bool = Field(
        False, description="Start against a Redis whose `maxmemory-policy` evicts keys (refused otherwise): "
        "sessions may then vanish after they were acknowledged."
    )
    host_tier_bytes: int = Field(
        2 * 1024**3, ge=1 << 20, description="Hard bound of the host tier (CPU memory for cold KV pages), per "
        "replica, with or without Redis: a turn whose demotions cannot fit or spill is refused with "
        "`host_memory_exhausted`."
    )
    page_tokens: int = Field(
        32, ge=4, le=1024, description="Tokens per cold page of one KV head: the unit that moves between tiers "
        "and carries a key digest."
    )
    reselect: Literal["digest", "exhaustive"] = Field(
        "digest",
        description="Tiered mode: a new turn reads back the cold pages whose key digests rank highest for its "
        "window (`digest`) or every cold page (`exhaustive`) before Stage 1 re-selects.",
    )
    digest_candidates: float = Field(
        1.0, gt=0, le=64, description="Tiered `digest` turns read this many cold tokens' worth of pages per KV "
        "head and layer, as a fraction of the turn's prompt budget."
    )
    page_grouping: Literal["keys", "position"] = Field(
        "position", description="Tiered `digest` mode: the tokens a turn demotes share cold pages with those whose "
        "keys are nearest (`keys`: tight bounds that rank pages well) or with their neighbours in the text "
        "(`position`: the runs Stage 1 keeps fill few pages; the grouping to use with a key sketch)."
    )
    sketch_bits: SketchBits = Field(
        4, description="Tiered `digest` mode: bits per channel of each cold token's key sketch (0: none). With a "
        "sketch a turn runs Stage 1 over the estimated keys of a pool of pages (`sketch_pool`) and reads the pages "
        "holding what it keeps; without one it ranks pages by their key bounds."
    )
    sketch_pool: float = Field(
        4.5, ge=1, le=1024, description="Tiered `digest` mode with a key sketch: the pages whose sketches a turn "
        "reads, as a multiple of the pages it fetches (those whose key bounds rank highest). A pool that holds "
        "every cold page is decoded for layer l+1 while layer l computes."
    )
    sketch_standin: bool = Field(
        True, description="Tiered `digest` mode with a key sketch: as many unread pool pages as a turn reads, those "
        "carrying the most window mass, are attended over through their sketched keys and values (each cold "
        "token also keeps a value sketch)."
    )
    digest_read_whole: float = Field(
        1.5, ge=0, le=1024, description="Tiered `digest` mode: a layer whose cold pages are at most this many times "
        "those a turn reads (`digest_candidates`) is read whole, as `exhaustive` reads it, and its selection applied "
        "at once (0: never): ranking so few pages costs more than it saves, and the turn's device bound is smaller."
    )
    cold_dtype: Literal["model", "int8"] = Field(
        "model", description="How cold pages are stored in host memory and Redis: in the model's dtype "
        "(bit-exact) or int8 with per-channel key and per-token value scales (about half the bytes of bf16)."
    )
    prefill_attention: Literal["dense", "selected"] = Field(
        "dense",
        description="Tiered mode: a new turn's tokens attend over everything the turn read (the primary set, "
        "the cold pages read back and the turn itself) or only over the re-selected primary set.",
    )
    device_budget_bytes: int = Field(
        0,
        ge=0,
        description="Device memory for session KV caches per replica (0: unlimited). A turn is admitted only "
        "if it fits with what the other sessions hold, after parking least recently used idle sessions "
        "off the device; while turns in flight hold the room it needs it waits for them (`admission_wait_s`); "
        "otherwise it is refused with `device_memory_exhausted`.",
    )
    admission_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a turn waits, in arrival order, for turns in flight to release the device memory "
        "it needs before it is refused with `device_memory_exhausted` (0: refuse at once).",
    )
    prefill_chunk: int = Field(
        512,
        ge=0,
        description="Most prefill tokens one model step carries. A longer first prompt is fed layer by layer (each "
        "layer over the whole prompt in groups of at most this many rows, compressed before the next layer runs, "
        "between the decode steps of the sessions generating meanwhile); a longer later prompt runs as several "
        "steps that carry those decode tokens too (compression waits for its last chunk). Same tokens as whole. "
        "0: a prefill always runs whole, in one step.",
    )
    replay_max_tokens: int = Field(
        8192,
        ge=0,
        description="Most history tokens a lost cache (cold pages gone with Redis) is rebuilt from by replaying the "
        "session's turns as they were fed: one prefill per turn and one decode step per generated token, which gives "
        "the very cache that was lost. A longer history is prefilled again in one go instead (another cache, so "
        "possibly other replies, at the cost of one prefill). 0: never replay.",
    )
    kernels: Literal["auto", "torch", "triton", "native"] = Field(
        "auto",
        description="'auto' uses Triton kernels for CUDA tensors and, on CPU, the native C kernels for HSA's "
        "decode step, a sketch pool's window mass, Stage 1's choice over slots in any order and a tiered "
        "turn's attention exponentials (built on "
        "first use with the machine's C compiler; torch where none is found); 'native' requires them; "
        "'torch' uses the torch references everywhere.",
    )

    @model_validator(mode="after")
    def _wait_within_socket_timeout(self) -> "Settings":
        # A WAIT longer than the socket timeout would read as a failed save although the record committed.
        if self.redis_min_replicas and self.redis_wait_timeout_s >= self.redis_timeout_s:
            raise ValueError("RKV_REDIS_WAIT_TIMEOUT_S must be below RKV_REDIS_TIMEOUT_S (the socket timeout a "
                             "save's WAIT is read under)")
        return self


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
    replica_resources: dict[str, float] = Field(
        {},
        description="Ray custom resources per chat replica (JSON, e.g. {\"chat\": 1}): replicas only land on "
        "nodes started with them (`ray start --resources`), so a cluster keeps them off its head.",
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="Concurrent requests one chat replica accepts (turns, cancels, lookups)."
    )
    ingress_max_ongoing_requests: int = Field(
        1000, ge=1, description="Concurrent requests of the HTTP ingress; each open WebSocket holds one."
    )
    placement: Literal["memory", "hash"] = Field(
        "memory",
        description="Where a session not held by any replica (new, or its replica gone) goes: the replica with the "
        "most free device memory, then fewest sessions, then most host-tier room, as the replicas last reported "
        "(`memory`; ties by rendezvous hash), or the rendezvous hash of its id alone (`hash`). A held session "
        "stays with its replica either way.",
    )
    max_sessions_per_replica: int = Field(
        1024,
        ge=1,
        description="Sessions a replica holds in memory: at the limit, idle sessions that Redis keeps are "
        "dropped first, then new sessions get `too_many_sessions`. Also what it advertises to the router.",
    )

    # Security and limits (README: Security and limits)
    api_key: str | None = Field(
        None,
        repr=False,
        description="Comma-separated API keys. When set, every endpoint but /healthz (and the static chat page) "
        "needs `Authorization: Bearer <key>`; sessions belong to the key that made them.",
    )
    max_request_bytes: int = Field(
        8 * 1024**2, ge=1024, description="Largest HTTP request body and WebSocket frame, in bytes."
    )
    ws_frames_per_s: float = Field(
        20.0, gt=0, description="Sustained client frames per second one WebSocket connection may send."
    )
    ws_frame_burst: int = Field(40, ge=1, description="Frames a WebSocket connection may send at once above the rate.")
    ws_auth_timeout_s: float = Field(
        10.0, gt=0, description="How long a WebSocket without a key in its handshake has to send its `auth` frame."
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
    refuse_unsaved_turns: bool = Field(
        False, description="Refuse a turn that cannot be saved (`store_unavailable`; a finished turn whose save "
        "failed is taken back) instead of answering it from memory with `saved: false` and saving it later."
    )
    quota_sessions: int = Field(
        0, ge=0, description="Most sessions one API key (or, without keys, all callers together) may keep in Redis; "
        "0: no limit. Beyond it new sessions get `quota_exceeded`."
    )
    quota_bytes: int = Field(
        0, ge=0, description="Most bytes one API key's sessions may keep in Redis (records and KV); 0: no limit. "
        "Beyond it new turns get `quota_exceeded`."
    )


class ServerSettings(ServeSettings, Settings):
    """Engine and serving settings together, as the server and its replicas use them."""

    model_config = SettingsConfigDict(env_prefix="RKV_", extra="ignore")

    # A server chats with the best model a first run fetches (`make serve` fetches it; docs/benchmarks.md,
    # "chat"); the engine's own default, which evals, benchmarks and tests load, stays the small bundled one.
    model: str = Field(
        SERVED_MODEL,
        description="Model to serve: Qwen2.5-Coder-0.5B-Instruct (`rocketkv-mt model fetch qwen2.5-coder-0.5b`), "
        "another bundled model (`bundled:smollm2-135m`, installed by `make setup`; app/model_registry.py), a "
        "Hugging Face id, or a local path.",
    )
