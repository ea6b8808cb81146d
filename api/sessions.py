"""Session REST API. A session's secret travels in the ``x-session-token`` header.

Unknown ids, wrong tokens and sessions of another API key all answer 404 ``session_not_found``.
The listing shows the caller's own sessions (all of them without API keys): ids and sizes, never
messages or tokens.
"""
from __future__ import annotations

from fastapi import APIRouter, Body, Header, Query, Request, Response

from api.auth import request_owner as owner
from api.schemas import CreateSessionRequest, MemoryMap, SessionDetail, SessionExport, SessionInfo, SessionList
from app.contract.service import SessionService

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
TOKEN_HEADER = "x-session-token"


def _service(request: Request) -> SessionService:
    return request.app.state.service


def _replica(response: Response, payload: dict) -> dict:
    if payload.get("replica"):
        response.headers["x-replica"] = payload["replica"]
    return payload


@router.post("", status_code=201, response_model=SessionInfo)
async def create_session(request: Request, response: Response, body: CreateSessionRequest | None = Body(None)):
    body = body or CreateSessionRequest()
    return _replica(response, await _service(request).create_session(body.mode, body.budget, body.system, owner(request)))


@router.get("", response_model=SessionList)
async def list_sessions(request: Request):
    return {"sessions": await _service(request).list_sessions(owner(request))}


@router.post("/import", status_code=201, response_model=SessionInfo)
async def import_session(request: Request, response: Response, body: SessionExport):
    data = body.model_dump(exclude={"format", "session_id"})
    return _replica(response, await _service(request).import_session(data, owner(request)))


@router.get("/{session_id}", response_model=SessionDetail)
async def get_session(
    session_id: str, request: Request, response: Response, token: str | None = Header(None, alias=TOKEN_HEADER)
):
    return _replica(response, await _service(request).get_session(session_id, token, owner(request)))


@router.get("/{session_id}/export", response_model=SessionExport)
async def export_session(
    session_id: str, request: Request, token: str | None = Header(None, alias=TOKEN_HEADER)
):
    return await _service(request).export_session(session_id, token, owner(request))


@router.get("/{session_id}/memory-map", response_model=MemoryMap)
async def memory_map(
    session_id: str, request: Request, response: Response, token: str | None = Header(None, alias=TOKEN_HEADER),
    text: bool = Query(False, description="Also each position's token text (``tokens``)."),
):
    """Where every token of the session is, per layer and KV head: device, host tier, Redis (or
    evicted, unfed), and which the last turn re-admitted or demoted; run-length encoded."""
    return _replica(response, await _service(request).memory_map(session_id, token, owner(request), text))


@router.delete("/{session_id}", status_code=204)
async def delete_session(session_id: str, request: Request, token: str | None = Header(None, alias=TOKEN_HEADER)):
    saved = await _service(request).delete_session(session_id, token, owner(request))
    # How durably the delete was written (as a turn's ``storage.durability``): a delete that was not durable
    # may come undone if Redis loses its last writes.
    headers = {"x-rkv-durability": saved["durability"]} if saved else {}
    return Response(status_code=204, headers=headers)
