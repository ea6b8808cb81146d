"""OpenAI-compatible ``POST /v1/chat/completions`` and ``GET /v1/models``.

Every call runs in a session. Without an ``x-session-id`` header a new session is seeded with
all messages but the last (their tokens are prefilled) and the last, a user message, is the turn.
With ``x-session-id`` (and its ``x-session-token``) the messages before the last must equal the
session's stored history, role for role and content for content; then only the last message
is prefilled. A history that does not match answers 409 ``history_mismatch`` and leaves the
session alone: silently starting over would hide a client bug and cost a full prefill.
Responses carry ``x-session-id``/``x-session-token`` (to continue) and ``x-replica``;
``usage.prefilled_tokens`` says how many prompt tokens were actually prefilled, and ``storage`` what the
turn's save gave (saved, durable: README, "What a client can rely on"). A request sent
again with the same ``Idempotency-Key`` header (and ``x-session-id``) gets the finished turn's
answer instead of running it a second time.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.errors import ApiError
from api.auth import request_owner
from api.metrics import Metrics
from api.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    ChunkDelta,
    CompletionUsage,
    ModelCard,
    ModelList,
)
from api.wire import wire_stream
from app.contract.service import SessionService

router = APIRouter(tags=["openai"])
STARTED = int(time.time())


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(done: dict[str, Any]) -> CompletionUsage:
    u = done["usage"]
    return CompletionUsage(
        prompt_tokens=u["prompt_tokens"],
        completion_tokens=u["generated_tokens"],
        total_tokens=u["prompt_tokens"] + u["generated_tokens"],
        prefilled_tokens=u["prefilled_tokens"],
    )


def _sampling(req: ChatCompletionRequest) -> dict[str, Any]:
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    values = {**req.sampling(), "max_tokens": req.max_completion_tokens or req.max_tokens, "stop": stop}
    return {k: v for k, v in values.items() if v is not None}


def _split(req: ChatCompletionRequest) -> tuple[list[dict[str, str]], str]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    if messages[-1]["role"] != "user":
        raise ApiError("invalid_request", "the last message must be a user message")
    return messages[:-1], messages[-1]["content"]


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request):
    return ModelList(data=[ModelCard(id=request.app.state.service.model_name, created=STARTED)])


@router.post("/v1/chat/completions")
async def chat_completions(
    req: ChatCompletionRequest,
    request: Request,
    session_id: str | None = Header(None, alias="x-session-id"),
    session_token: str | None = Header(None, alias="x-session-token"),
    idempotency_key: str | None = Header(None, alias="idempotency-key", min_length=1, max_length=128),
):
    service: SessionService = request.app.state.service
    metrics: Metrics = request.app.state.metrics
    caller = request_owner(request)
    if req.model != service.model_name:
        raise ApiError("model_not_found", f"model {req.model!r} is not served; see /v1/models")
    if req.n != 1:
        raise ApiError("invalid_request", "only n=1 is supported")
    history, content = _split(req)
    if session_id:
        expected = [[m["role"], m["content"]] for m in history]
        created = False
    else:
        info = await service.import_session({"mode": req.mode, "budget": req.budget, "messages": history}, caller)
        session_id, session_token, expected, created = info["session_id"], info["token"], None, True

    events = wire_stream(service.chat(session_id, session_token, content, _sampling(req), expected, caller,
                                      idempotency_key))
    start = await anext(events)
    if start["type"] == "error":
        metrics.observe(start)
        await events.aclose()
        if created:  # nobody can use a session whose first turn was refused
            await service.delete_session(session_id, session_token, caller)
        raise ApiError.from_event(start)
    headers = {"x-session-id": session_id, "x-session-token": session_token or "", "x-replica": start["replica"]}
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _sse(events, metrics, cid, req.model, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    return await _collect(events, metrics, cid, req.model, session_id, headers)


async def _collect(events, metrics: Metrics, cid: str, model: str, session_id: str, headers: dict) -> JSONResponse:
    parts: list[str] = []
    async for event in events:
        metrics.observe(event)
        if event["type"] == "delta":
            parts.append(event["text"])
        elif event["type"] == "error":
            raise ApiError.from_event(event)
        elif event["type"] == "done":
            completion = ChatCompletion(
                id=cid,
                created=int(time.time()),
                model=model,
                choices=[Choice(message=AssistantMessage(content="".join(parts)),
                                finish_reason=_finish_reason(event["finish_reason"]))],
                usage=_usage(event),
                session_id=session_id,
                replica=event["replica"],
                storage=event.get("storage"),
            )
            return JSONResponse(completion.model_dump(), headers=headers)
    raise ApiError("internal_error", "the turn ended without a result")


def _data(obj: Any) -> str:
    payload = obj.model_dump_json(exclude_none=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {payload}\n\n"


async def _sse(events, metrics: Metrics, cid: str, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: ChunkDelta, finish: str | None = None, usage: CompletionUsage | None = None, choices=True,
              storage=None):
        return ChatCompletionChunk(
            id=cid, created=created, model=model, usage=usage, storage=storage,
            choices=[ChunkChoice(delta=delta, finish_reason=finish)] if choices else [],
        )

    try:
        yield _data(chunk(ChunkDelta(role="assistant", content="")))
        async for event in events:
            metrics.observe(event)
            if event["type"] == "delta":
                yield _data(chunk(ChunkDelta(content=event["text"])))
            elif event["type"] == "error":
                yield _data({"error": {"code": event["code"], "message": event["message"]}})
            elif event["type"] == "done":
                yield _data(chunk(ChunkDelta(), _finish_reason(event["finish_reason"]), storage=event.get("storage")))
                if include_usage:
                    yield _data(chunk(ChunkDelta(), usage=_usage(event), choices=False))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()
