"""The engine's own exception types. Each carries a stable ``code`` that the APIs return as-is."""
from __future__ import annotations


class EngineError(Exception):
    code = "engine_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    code = "invalid_request"


class EmptyMessage(InvalidRequest):
    code = "empty_message"


class MessageTooLarge(InvalidRequest):
    code = "message_too_large"


class MaxTokensTooLarge(MessageTooLarge):
    code = "max_tokens_too_large"


class InvalidSamplingParams(InvalidRequest):
    code = "invalid_sampling_params"


class UnknownMode(InvalidRequest):
    code = "unknown_mode"


class ContextLengthExceeded(EngineError):
    code = "context_length_exceeded"


class DeviceMemoryExhausted(EngineError):
    """The replica's device budget cannot hold this turn, even after parking idle sessions."""

    code = "device_memory_exhausted"


class SessionNotFound(EngineError):
    code = "session_not_found"


class SessionBusy(EngineError):
    code = "session_busy"
