"""What ``Engine.chat`` yields: text deltas, then exactly one ``TurnDone`` (its ``Usage`` and
``MemoryStats`` are the contract's, ``app.contract.events``, which the service passes on as they are);
before the first delta, ``TurnStatus`` events while the turn rebuilds a lost cache."""
from __future__ import annotations

from dataclasses import dataclass

from app.contract.events import MemoryStats, Usage

__all__ = ["MemoryStats", "TextDelta", "TurnDone", "TurnStatus", "Usage"]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class TurnStatus:
    """How far work before the reply has got, where it can take a while: ``stage`` "replay" (a lost
    cache rebuilt by feeding the earlier turns again, ``app.engine.replay``) has fed ``done`` of
    ``total`` turns, ``tokens`` of ``total_tokens`` tokens."""

    stage: str
    done: int
    total: int
    tokens: int
    total_tokens: int


@dataclass(frozen=True)
class TurnDone:
    finish_reason: str  # "stop" (EOS or a stop string), "length", "cancelled"
    text: str
    usage: Usage
    memory: MemoryStats
    ttft_ms: float
    latency_ms: float
