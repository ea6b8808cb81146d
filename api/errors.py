"""Error codes to HTTP statuses, and the one error body every HTTP endpoint returns.

Body: ``{"error": {"code", "message", "type", "param"}}`` (the OpenAI shape, with our ``code``).
The codes themselves are the service's (``app.contract.errors``) plus the ones only this layer
can detect, raised as ``ApiError``.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from api.schemas import ErrorBody, ErrorDetail, ErrorEvent
from app.contract.errors import ChatError

STATUS = {
    "unauthorized": 401,
    "request_too_large": 413,
    "too_many_sessions": 429,
    "rate_limited": 429,
    "session_not_found": 404,
    "model_not_found": 404,
    "session_busy": 409,
    "history_mismatch": 409,
    "session_moved": 409,
    "session_diverged": 409,
    "quota_exceeded": 429,
    "replica_unavailable": 503,
    "device_memory_exhausted": 503,
    "host_memory_exhausted": 503,
    "store_unavailable": 503,
    "internal_error": 500,
    "engine_error": 500,
}
TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(ChatError):
    """An error of the protocol layer (a bad frame, a missing key, ...), or any code with a set status."""

    def __init__(self, code: str, message: str, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status or STATUS.get(code, 400)

    @classmethod
    def from_event(cls, event: dict) -> "ApiError":
        return cls(event.get("code", "internal_error"), event.get("message", ""))


def http_status(exc: ChatError) -> int:
    return getattr(exc, "status", None) or STATUS.get(exc.code, 400)


def error_body(code: str, message: str, status: int) -> dict:
    detail = ErrorDetail(code=code, message=message, type=TYPES.get(status, "invalid_request_error"))
    return ErrorBody(error=detail).model_dump()


def error_response(exc: ChatError, headers: dict[str, str] | None = None) -> JSONResponse:
    status = http_status(exc)
    return JSONResponse(error_body(exc.code, exc.message, status), status_code=status, headers=headers)


def error_event(code: str, message: str) -> dict:
    """The WebSocket/stream form of an error."""
    return ErrorEvent(code=code, message=message).model_dump()
