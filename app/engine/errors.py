"""The errors the engine raises; the tree and its codes live in ``app.contract.errors``."""
from app.contract.errors import (
    ChatError,
    ContextLengthExceeded,
    DeviceMemoryExhausted,
    EmptyMessage,
    EngineError,
    HostMemoryExhausted,
    InvalidRequest,
    InvalidSamplingParams,
    MaxTokensTooLarge,
    MessageTooLarge,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
    UnknownMode,
)


class TurnCancelled(Exception):
    """Raised inside the engine to stop a turn between two chunks of its prefill (never to callers)."""


__all__ = [
    "ChatError",
    "ContextLengthExceeded",
    "DeviceMemoryExhausted",
    "EmptyMessage",
    "EngineError",
    "HostMemoryExhausted",
    "InvalidRequest",
    "InvalidSamplingParams",
    "MaxTokensTooLarge",
    "MessageTooLarge",
    "SessionBusy",
    "SessionNotFound",
    "StoreUnavailable",
    "TurnCancelled",
    "UnknownMode",
]
