"""The browser chat page: ``GET /`` serves ``api/static/index.html``, ``GET /static/{name}`` its assets.

Plain HTML/JS/CSS with no build step and nothing fetched from other origins. The files are read
relative to this module (``Path(__file__).parent / "static"``), so an editable install and a wheel
that ships ``api/static/*`` as package data both work. Only the files present in that folder are
served (no sub-folders, no path traversal); anything else is the usual ``404`` error body.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from api.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".ico": "image/x-icon",
}
# The page is small and changes with the server; let browsers revalidate instead of caching stale JS.
NO_CACHE = {"cache-control": "no-cache"}

router = APIRouter(include_in_schema=False, tags=["ui"])


def _asset(name: str) -> Path:
    path = STATIC_DIR / name
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in MEDIA_TYPES or not path.is_file():
        raise ApiError("not_found", f"no static file {name!r}", status=404)
    return path


@router.get("/")
async def index():
    return FileResponse(_asset("index.html"), media_type=MEDIA_TYPES[".html"], headers=NO_CACHE)


@router.get("/static/{name}")
async def static_file(name: str):
    path = _asset(name)
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=NO_CACHE)
