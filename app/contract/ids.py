"""Session ids and session tokens: how they are made and what counts as one.

An id is chosen before any replica is involved (the Ray router keys on it), so the caller of the
service makes it, with ``new_session_id``. Anything that does not look like one cannot be a
session, and must not reach routing or Redis key names (``:`` or glob characters there would
address other keys).
"""
from __future__ import annotations

import re
import secrets
from typing import Any

# What ``new_session_id`` makes (and a little slack).
SESSION_ID = re.compile(r"s_[A-Za-z0-9_-]{1,64}")


def new_session_id() -> str:
    """``s_`` and 144 random bits."""
    return "s_" + secrets.token_urlsafe(18)


def is_session_id(value: Any) -> bool:
    return isinstance(value, str) and SESSION_ID.fullmatch(value) is not None


def new_session_token() -> str:
    """A session's secret (192 bits); only its digest is stored."""
    return secrets.token_urlsafe(24)


def new_turn_key() -> str:
    """An idempotency key for a turn whose caller gave none (96 random bits): every attempt of one
    request carries it, so a retry cannot run the turn twice (``app.session_turns``)."""
    return "t_" + secrets.token_urlsafe(12)
