"""Rebuilding a lost cache exactly: the same tokens, fed through the same steps, in the same order.

A session's cache is a deterministic function of what it was fed since it was created: each turn's
prefill (its tokens, and the ``max_new`` that its budget split used), the decode steps of the reply
(each feeds the token sampled before it), and the turn's end (where a tiered cache settles its
re-selection). When part of a cache is lost — cold pages spilled to a Redis that went away — feeding
the same tokens again through the same steps rebuilds the very same cache, so the next reply is the
one the lost cache would have given. Feeding the history in one prefill instead would give another
cache (other selections, other re-admissions), and so other replies.

The cost is that of the conversation so far: one prefill per turn and one decode step per token
generated. A log that does not account for the whole fed history (a session restored from a record
of another process keeps none) falls back to one prefill of the history.
"""
from __future__ import annotations

from app.engine.batcher import Batcher
from app.engine.session import Feed
from rocketkv_mt.cache import SessionCache


def replayable(feeds: list[Feed], fed: int) -> bool:
    """Whether ``feeds`` account for exactly the ``fed`` tokens the lost cache had been given."""
    return bool(feeds) and sum(f.prefill + f.decodes for f in feeds) == fed


async def replay(batcher: Batcher, key: str, cache: SessionCache, token_ids: list[int], feeds: list[Feed]) -> None:
    """Feed an empty ``cache`` the first tokens of ``token_ids`` as ``feeds`` say they were fed."""
    pos = 0
    for feed in feeds:
        await batcher.prefill(key, cache, token_ids[pos : pos + feed.prefill], feed.max_new)
        pos += feed.prefill
        for token in token_ids[pos : pos + feed.decodes]:
            await batcher.decode(key, cache, token)
        pos += feed.decodes
        cache.end_turn()
