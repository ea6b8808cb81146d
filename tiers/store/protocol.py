"""What the tiers need of a store beyond this process: items of one session, named ``group/field``.

A group is the unit whose lifetime the store keeps: one demotion batch's pages (``tiers.cold.ids``) or
one generation's tables (``tiers.session_kv``). It is written *pending*: it expires ``pending_ttl_s``
after it was made unless its holder renews it, or a session record's commit names it (which makes it
live as long as the record, and deletes what the record no longer names: ``app.session_store``). So
nothing a crashed or cut-off holder wrote outlives the short TTL, and nothing a record names goes before
the record: no sweeper. The tiers above and ``rocketkv_mt`` speak only to this protocol; the Redis
backends live in ``tiers.store.redis``. Every call is about one session, blocks its caller, and fails
soft: None or False means the store could not be asked (``stats.errors``), never an exception.
"""
from __future__ import annotations

from typing import Protocol

from tiers.base import PageBatch, TierStats


def group_of(name: str) -> str:
    """The group an item belongs to (the part of its name before the ``/``)."""
    return name.partition("/")[0]


class PageStore(Protocol):
    stats: TierStats
    pending_ttl_s: int  # how long a group no record names lives without a renewal
    last_error: str | None  # why the last call failed, for /healthz

    def unavailable(self, session_id: str | None = None) -> bool:
        """Whether a call on the session's items now would fail at once (the store failed lately and
        has not been probed since); no session: whether every call would."""

    def put(self, session_id: str, items: dict[str, PageBatch]) -> bool:
        """Write items (name -> tensors) in one round trip, their new groups pending; False on failure
        (some may have been written: they expire with their group, or are deleted by their holder)."""

    def get(self, session_id: str, names: list[str]) -> list[PageBatch | None]:
        """Items by name in one round trip; None where one is missing or the store cannot be read."""

    def has(self, session_id: str, names: list[str]) -> list[bool] | None:
        """Whether the store holds each item; None when it cannot be asked."""

    def sizes(self, session_id: str, groups: list[str]) -> list[int] | None:
        """Items each group holds (0: the group is gone); None when the store cannot be asked."""

    def renew(self, session_id: str, groups: list[str]) -> bool:
        """Give pending groups ``pending_ttl_s`` more, never shortening a longer life (a group a record names)."""

    def delete(self, session_id: str, names: list[str]) -> bool:
        """Remove items (``group/field``) or whole groups (``group``); False on failure (they expire)."""

    def session_bytes(self, session_id: str) -> int:
        """Bytes this process wrote for the session and still counts."""

    def forget(self, session_id: str) -> None:
        """Stop counting a session that left this process (its items stay for whoever restores it)."""
