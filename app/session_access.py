"""Who may open a session: its owner (the API key that made it, ``None`` without keys) together with
its token. The one place where owner and token are checked.

A session's token is issued once, when it is made; only its digest is kept (here, and in the
stored record). An id that is malformed, unknown or someone else's, and a wrong token, all get the
same ``session_not_found``: nothing tells a caller whether a session exists.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any

from app.contract.errors import SessionNotFound
from app.contract.ids import is_session_id, new_session_token
from app.engine.session import Session


def token_digest(token: str) -> str:
    # surrogatepass: a client's "\ud800" must make a wrong token, not an exception.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_matches(token: str | None, digest: str | None) -> bool:
    if not digest or not isinstance(token, str):
        return False
    return hmac.compare_digest(token_digest(token), digest)


def refuse(sid: Any) -> SessionNotFound:
    return SessionNotFound(f"no session {sid!r}" if is_session_id(sid) else "no such session")


class SessionAccess:
    """The token digests of the sessions this replica holds."""

    def __init__(self) -> None:
        self._digests: dict[str, str] = {}

    def issue(self, sid: str) -> str:
        """A new token for a new session; the caller gets it once."""
        token = new_session_token()
        self._digests[sid] = token_digest(token)
        return token

    def grant(self, sid: str, digest: str) -> None:
        """Take a restored session's digest from its stored record."""
        self._digests[sid] = digest

    def digest(self, sid: str) -> str | None:
        return self._digests.get(sid)

    def holds(self, sid: str) -> bool:
        """Whether the session was made or restored through this service (not, say, a probe)."""
        return sid in self._digests

    def forget(self, sid: str) -> None:
        self._digests.pop(sid, None)

    @staticmethod
    def check_id(sid: Any) -> None:
        """Refuse what cannot be a session id before it reaches a lookup or a Redis key."""
        if not is_session_id(sid):
            raise refuse(sid)

    def check(self, session: Session, token: str | None, owner: str | None) -> None:
        if session.owner != owner or not token_matches(token, self._digests.get(session.id)):
            raise refuse(session.id)

    @staticmethod
    def check_record(sid: str, record: dict[str, Any] | None, token: str | None, owner: str | None) -> None:
        """The same check against a stored record, before anything of it is loaded."""
        if record is None or record.get("owner") != owner or not token_matches(token, record.get("token_sha256")):
            raise refuse(sid)
