"""What ``Engine.chat`` yields: text deltas, then exactly one ``TurnDone``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    prefilled_tokens: int
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
class TurnDone:
    finish_reason: str  # "stop" (EOS or a stop string), "length", "cancelled"
    text: str
    usage: Usage
    memory: MemoryStats
    ttft_ms: float
    latency_ms: float
