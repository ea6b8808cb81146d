"""The errors the engine raises; the tree and its codes live in ``app.contract.errors``."""
from app.contract.errors import (
    ChatError,
    ContextLengthExceeded,
    DeviceMemoryExhausted,
    EmptyMessage,
    EngineError,
    InvalidRequest,
    InvalidSamplingParams,
    MaxTokensTooLarge,
    MessageTooLarge,
    SessionBusy,
    SessionNotFound,
    UnknownMode,
)

__all__ = [
    "ChatError",
    "ContextLengthExceeded",
    "DeviceMemoryExhausted",
    "EmptyMessage",
    "EngineError",
    "InvalidRequest",
    "InvalidSamplingParams",
    "MaxTokensTooLarge",
    "MessageTooLarge",
    "SessionBusy",
    "SessionNotFound",
    "UnknownMode",
]
