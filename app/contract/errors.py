"""Every error a client can be told about, as one tree of exception classes with stable codes.

The engine and the service raise these; ``api`` maps each ``code`` to an HTTP status and an error
body or event (``api.errors``). A code crosses a process boundary as ``{code, message}`` and comes
back as the same class through ``ChatError.from_code``. The codes that only the protocol layer
can detect (``invalid_json``, ``unauthorized``, ``no_active_turn``, ...) are ``api.errors.ApiError``s.
"""
from __future__ import annotations


class ChatError(Exception):
    """The root: a failure with a stable ``code`` that the APIs return as-is."""

    code = "engine_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    @classmethod
    def from_code(cls, code: str, message: str) -> "ChatError":
        """The class of the tree that owns ``code`` (a plain ``ChatError`` carrying it otherwise)."""
        found = _find(cls, code)
        if found is not None:
            return found(message)
        error = ChatError(message)
        error.code = code
        return error


def _find(root: type[ChatError], code: str) -> type[ChatError] | None:
    if root.code == code:
        return root
    for sub in root.__subclasses__():
        found = _find(sub, code)
        if found is not None:
            return found
    return None


# Kept under the name the engine and its callers have always used.
EngineError = ChatError


class InternalError(ChatError):
    """A bug, not the client's fault."""

    code = "internal_error"


class InvalidRequest(ChatError):
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


class HistoryMismatch(InvalidRequest):
    """Messages sent as a session's history that are not its history."""

    code = "history_mismatch"


class ContextLengthExceeded(ChatError):
    code = "context_length_exceeded"


class DeviceMemoryExhausted(ChatError):
    """The replica's device budget cannot hold this turn, even after parking idle sessions."""

    code = "device_memory_exhausted"


class HostMemoryExhausted(ChatError):
    """The replica's host tier is full and nothing can spill to Redis (none, or it is failing): a turn
    that would demote pages there is refused before it runs, the session unchanged."""

    code = "host_memory_exhausted"


class SessionNotFound(ChatError):
    """Unknown, malformed, someone else's, or a wrong token: all the same to the caller."""

    code = "session_not_found"


class SessionBusy(ChatError):
    code = "session_busy"


class SessionMoved(ChatError):
    """The turn ran on a copy of the session that another replica had moved on from (or that was
    deleted) meanwhile: it was not kept; sent again, it runs on the current state."""

    code = "session_moved"


class SessionDiverged(SessionMoved):
    """Redis lost saves of the session that this replica had acknowledged (a failover to a lagging
    replica, a crash), and another replica has since gone on from the older state: the turns after
    the fork are lost, and the session continues from the stored state. Said once, to the next caller."""

    code = "session_diverged"


class TooManySessions(ChatError):
    code = "too_many_sessions"


class QuotaExceeded(ChatError):
    """The caller's API key keeps as many sessions, or as many bytes, in Redis as its quota allows."""

    code = "quota_exceeded"


class StoreUnavailable(ChatError):
    """The session is not on this replica and Redis is unreachable (or, where turns that cannot be saved
    are refused, Redis cannot take this turn now)."""

    code = "store_unavailable"


class ReplicaUnavailable(ChatError):
    """The replica serving the call died (mid-turn: the client sends the message again)."""

    code = "replica_unavailable"
