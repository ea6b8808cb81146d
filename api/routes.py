"""The FastAPI app: ``create_app(service)`` serves the same routes over any ``SessionService``.

Routes: WebSocket ``/v1/chat/ws``; ``/v1/sessions`` (REST); ``/v1/chat/completions`` and
``/v1/models`` (OpenAI); ``/healthz``; ``/metrics`` (Prometheus text). Every HTTP response has
an ``x-replica`` header: the replica that served the session when there is one, else the
process that answered. With API keys configured, ``api.auth.AuthGate`` stands in front of all
HTTP routes but the open ones, and ``api.limits.BodyLimit`` in front of every body.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from api import openai_compat, sessions, ui
from api.auth import ApiKeys, AuthGate
from api.errors import ApiError, error_response
from api.limits import BodyLimit
from api.metrics import CONTENT_TYPE, Metrics
from api.schemas import Health
from api.ws import ChatConnection
from app.contract.errors import ChatError
from app.contract.service import SessionService
from app.settings import ServeSettings

log = logging.getLogger(__name__)
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class ReplicaHeader:
    """Adds ``x-replica`` to HTTP responses that did not set one (pure ASGI: streaming-safe)."""

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (b"x-replica", replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-replica" for k, _ in headers):
                    headers.append(self.header)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


def create_app(service: SessionService, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    keys = ApiKeys(settings.api_key)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="rocketkv-mt", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.keys = keys
    app.include_router(sessions.router)
    app.include_router(openai_compat.router)
    app.include_router(ui.router)  # the browser chat page at / (api/ui.py)
    # The last added runs first: the size check before auth, and x-replica on every answer, refusals too.
    app.add_middleware(AuthGate, keys=keys, metrics=metrics)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, metrics=metrics)
    app.add_middleware(ReplicaHeader, replica=service.replica)

    @app.exception_handler(ChatError)  # the service's errors and this layer's own (ApiError)
    async def api_error(_: Request, exc: ChatError):
        metrics.error(exc.code)
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        # Starlette's own refusals (no such route, wrong method, an unparsable body) in our error shape.
        code = HTTP_CODES.get(exc.status_code, "internal_error" if exc.status_code >= 500 else "invalid_request")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        metrics.error(code)
        return error_response(ApiError(code, message, status=exc.status_code), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.error("request failed", exc_info=exc)
        metrics.error("internal_error")
        return error_response(ApiError("internal_error", "the server could not handle the request"))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError):
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        metrics.error("invalid_request")
        return error_response(ApiError("invalid_request", fields or "invalid request"))

    @app.get("/healthz", response_model=Health, response_model_exclude_none=True, tags=["ops"])
    async def healthz():
        try:
            extra = await service.health()
        except Exception as exc:  # a health check must answer, whatever broke
            log.warning("health check failed", exc_info=True)
            extra = {"redis": {"ok": False, "error": f"{type(exc).__name__}: {exc}"}}
        degraded = extra.get("redis") is not None and not extra["redis"]["ok"]
        return Health(status="degraded" if degraded else "ok", replica=service.replica, model=service.model_name,
                      backend=service.kind, **extra)

    @app.get("/metrics", tags=["ops"])
    async def prometheus():
        try:
            snapshot = await service.stats()
        except Exception:
            log.warning("service stats unavailable", exc_info=True)
            snapshot = {}
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE)

    @app.websocket("/v1/chat/ws")
    async def chat_ws(ws: WebSocket):
        await ChatConnection(ws, service, metrics, keys, settings).run()

    return app
