"""API keys: who is calling, and the HTTP gate in front of every route.

With ``RKV_API_KEY`` unset the server is open and every caller is the anonymous owner ``None``.
With keys set, a caller is identified by a digest of its key (``owner``): sessions belong to the
owner that made them, and another owner asking for one gets the same ``session_not_found`` as for
an id that does not exist. Keys are compared with ``hmac.compare_digest`` against every configured
key, so the time taken does not say which key (or how much of one) matched.

HTTP: ``Authorization: Bearer <key>`` on everything but ``OPEN_PATHS`` (the health check, and the
chat page with its assets, which hold no data: the page asks for the key). WebSocket: checked by
``api.ws`` because it may also come as ``?api_key=`` or as a first ``auth`` frame.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from api.errors import ApiError, error_body

OPEN_PATHS = ("/healthz", "/", "/favicon.ico")
OPEN_PREFIXES = ("/static/",)
UNAUTHORIZED = "a valid API key is needed: 'Authorization: Bearer <key>'"


def owner_of(key: str) -> str:
    """The identity sessions are filed under: not the key itself, which is never stored."""
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class ApiKeys:
    def __init__(self, spec: str | None):
        self._keys = [k.strip().encode() for k in (spec or "").split(",") if k.strip()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def owner(self, key: str | None) -> str | None:
        """The owner of a valid key; raises ``unauthorized`` otherwise (never when keys are off)."""
        if not self.enabled:
            return None
        if not isinstance(key, str) or not key:
            raise ApiError("unauthorized", UNAUTHORIZED)
        given = key.encode("utf-8", "surrogatepass")
        matched = False
        for known in self._keys:  # no early exit: every key is compared every time
            matched |= hmac.compare_digest(given, known)
        if not matched:
            raise ApiError("unauthorized", UNAUTHORIZED)
        return owner_of(key)


def bearer(value: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, else None."""
    if not value:
        return None
    scheme, _, key = value.strip().partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None


def request_owner(request) -> str | None:
    """Who is calling, as ``AuthGate`` filed it (None without API keys)."""
    return getattr(request.state, "owner", None)


def header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class AuthGate:
    """Pure ASGI middleware: refuses HTTP requests without a valid key, files the owner in ``scope["state"]``.

    WebSocket scopes pass through with nothing filed; ``api.ws`` authenticates them itself.
    """

    def __init__(self, app, keys: ApiKeys, metrics=None):
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        owner = None
        if self.keys.enabled and not is_open(scope.get("path", "")):
            try:
                owner = self.keys.owner(bearer(header(scope, b"authorization")))
            except ApiError as exc:
                if self.metrics is not None:
                    self.metrics.error(exc.code)
                return await refuse(send, 401, exc, extra=[(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)


async def refuse(send, status: int, exc: ApiError, extra: list | None = None) -> None:
    """Answer an HTTP request with the usual error body, from ASGI middleware."""
    body = json.dumps(error_body(exc.code, exc.message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
