"""What a turn streams to its caller: ``TurnStarted``, ``Delta``s, then one ``Done``; or one
``TurnFailed`` (before anything else when the turn cannot start, or after the last delta when it
breaks or its replica is lost). ``Status`` events may come before the first delta, while the turn
does work that takes a while before it can reply (rebuilding a lost cache).

Frozen dataclasses, so they cross a Ray boundary as they are; ``as_dict`` is the plain-data form
that ``api`` validates into its wire events.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from app.contract.errors import ChatError


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # whole history at the start of the turn, new message included
    prefilled_tokens: int  # tokens the turn fed through the model before decoding
    generated_tokens: int


@dataclass(frozen=True)
class MemoryStats:
    device_bytes: int
    host_bytes: int = 0
    redis_bytes: int = 0
    readmitted_tokens: int = 0
    history_tokens: int = 0
    device_tokens: int = 0
    # Bytes the last turn moved between tiers (``tiers.base.Traffic``).
    cold_bytes_read: int = 0
    redis_bytes_read: int = 0
    digest_bytes_read: int = 0
    bytes_demoted: int = 0
    redis_bytes_written: int = 0


@dataclass(frozen=True)
class MapSummary:
    """The memory map in a few numbers (``rocketkv_mt.cache.memory_map``): token slots (one position of
    one layer and one KV head) per state, and those the last turn re-admitted and demoted."""

    layers: int = 0
    kv_heads: int = 0
    positions: int = 0
    device: int = 0
    host: int = 0
    redis: int = 0
    evicted: int = 0
    unfed: int = 0
    lost: int = 0
    readmitted: int = 0
    demoted: int = 0


@dataclass(frozen=True)
class Saved:
    """What a turn's save gave. ``saved``: the session's record in Redis holds the turn, so any replica
    restores it; ``durable``: a crash of the Redis primary does not lose it either. ``durability``:
    "none" (not saved: the turn lives in this replica's memory until Redis takes it), "memory" (in
    Redis's memory only), "fsync" (Redis fsyncs every write, ``appendfsync always``), "replicated"
    (``replicas`` Redis replicas took it, at least ``RKV_REDIS_MIN_REPLICAS``)."""

    saved: bool
    durable: bool
    durability: str
    replicas: int = 0


NOT_SAVED = Saved(False, False, "none")


class _Event:
    type: ClassVar[str]

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, **dataclasses.asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True)
class TurnStarted(_Event):
    """The turn was accepted, and where: the caller learns the replica before any text."""

    session_id: str
    replica: str
    type: ClassVar[str] = "start"


@dataclass(frozen=True)
class Delta(_Event):
    text: str
    type: ClassVar[str] = "delta"


@dataclass(frozen=True)
class Status(_Event):
    """Progress of work before the reply: ``stage`` "replay" has replayed ``done`` of ``total`` earlier
    turns (``tokens`` of ``total_tokens`` tokens) to rebuild the session's lost cache."""

    stage: str
    done: int
    total: int
    tokens: int
    total_tokens: int
    type: ClassVar[str] = "status"


@dataclass(frozen=True)
class Done(_Event):
    finish_reason: str  # "stop" (EOS or a stop string), "length", "cancelled"
    usage: Usage
    memory: MemoryStats
    replica: str
    session_id: str
    ttft_ms: float = 0.0
    latency_ms: float = 0.0
    memory_map: MapSummary | None = None
    storage: Saved | None = None  # None: no session store (no Redis)
    sampling: dict[str, Any] | None = None  # what the turn was drawn with (None: a turn answered again)
    type: ClassVar[str] = "done"


@dataclass(frozen=True)
class TurnFailed(_Event):
    code: str
    message: str
    type: ClassVar[str] = "error"

    @classmethod
    def of(cls, error: ChatError) -> "TurnFailed":
        return cls(error.code, error.message)

    def error(self) -> ChatError:
        return ChatError.from_code(self.code, self.message)


TurnEvent = Union[TurnStarted, Status, Delta, Done, TurnFailed]
