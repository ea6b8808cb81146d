"""The names of a session's keys in Redis: one hash tag per session, so that they share a cluster slot.

``{ns}:session:{<id>}`` is the session's record (``app.session_store``); its KV lives beside it:
``…:kv:<name>`` for each page and each generation's page tables and primary set, and ``…:names``, the
manifest: a hash of every ``<name>`` written under ``…:kv:`` to the writer (a process, ``writer_key``)
that wrote it last, added before the key itself, so that a session's KV can be found and removed
without scanning the keyspace, and what a dead writer left be told from what live ones are writing.
The braces make Redis Cluster hash only the session id: a session's record, manifest and pages sit in one slot, and a pipeline over
them is one round trip to one shard.
"""
from __future__ import annotations


def session_key(ns: str, session_id: str) -> str:
    return f"{ns}:session:{{{session_id}}}"


def kv_key(ns: str, session_id: str, name: str) -> str:
    return f"{session_key(ns, session_id)}:kv:{name}"


def manifest_key(ns: str, session_id: str) -> str:
    return f"{session_key(ns, session_id)}:names"


def writer_key(ns: str, writer: str) -> str:
    """A writer's liveness: it exists while the process that writes as ``writer`` lives (renewed)."""
    return f"{ns}:writer:{writer}"


def writing_key(ns: str) -> str:
    """The log of which writer has written KV of which session (``<writer>|<session id>``), kept until the
    session leaves that writer: what a writer that died left is found there."""
    return f"{ns}:writing"


def table_names(gen: str, layers: int) -> list[str]:
    """The KV names of a generation's page tables and primary sets, layer by layer (``tiers.session_kv``)."""
    return [name for i in range(layers) for name in (f"{gen}.index-l{i}", f"{gen}.primary-l{i}")]


def tables_of(gens: dict[str, int]) -> list[str]:
    """``table_names`` of several generations (id -> layers)."""
    return [name for gen, layers in gens.items() for name in table_names(gen, layers)]


def session_pattern(ns: str) -> str:
    """A ``SCAN MATCH`` pattern for every key of every session (records, manifests and KV)."""
    return f"{ns}:session:*"


def session_of(ns: str, key: str) -> str | None:
    """The session id a key belongs to, or None for a key that is no session's."""
    head = f"{ns}:session:{{"
    if not key.startswith(head):
        return None
    end = key.find("}", len(head))
    return key[len(head) : end] if end >= 0 else None
