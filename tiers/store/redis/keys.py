"""The names of a session's keys in Redis: one hash tag per session, so that they share a cluster slot.

``{ns}:session:{<id>}`` is the session's record (``app.session_store``); its KV lives beside it, one
hash per group (``tiers.store.protocol``): ``…:kv:<group>``, a field per item. The braces make Redis
Cluster hash only the session id: a session's record and KV sit in one slot, a pipeline over them is
one round trip to one shard, and the script that commits a record can extend and delete its KV.
Listings read a per-owner index (``owner_key``), in the owner's own slot.
"""
from __future__ import annotations


def session_key(ns: str, session_id: str) -> str:
    return f"{ns}:session:{{{session_id}}}"


def kv_prefix(ns: str, session_id: str) -> str:
    """What a session's KV keys start with: the group's name follows."""
    return f"{session_key(ns, session_id)}:kv:"


def kv_key(ns: str, session_id: str, group: str) -> str:
    return kv_prefix(ns, session_id) + group


def owner_key(ns: str, owner: str | None) -> str:
    """An owner's sessions by expiry (a sorted set) and their stored bytes (``…:bytes``, a hash)."""
    return f"{ns}:owner:{{{owner or '-'}}}"


def session_pattern(ns: str) -> str:
    """A ``SCAN MATCH`` pattern for every key of every session (records and KV)."""
    return f"{ns}:session:*"


def session_of(ns: str, key: str) -> str | None:
    """The session id a key belongs to, or None for a key that is no session's."""
    head = f"{ns}:session:{{"
    if not key.startswith(head):
        return None
    end = key.find("}", len(head))
    return key[len(head) : end] if end >= 0 else None
