"""What ``Engine.chat`` yields: text deltas, then exactly one ``TurnDone`` (its ``Usage`` and
``MemoryStats`` are the contract's, ``app.contract.events``, which the service passes on as they are)."""
from __future__ import annotations

from dataclasses import dataclass

from app.contract.events import MemoryStats, Usage

__all__ = ["MemoryStats", "TextDelta", "TurnDone", "Usage"]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class TurnDone:
    finish_reason: str  # "stop" (EOS or a stop string), "length", "cancelled"
    text: str
    usage: Usage
    memory: MemoryStats
    ttft_ms: float
    latency_ms: float
