"""A chat session: its messages, its token ids and its KV cache."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from rocketkv_mt.cache import SessionCache
from rocketkv_mt.config import RocketKVConfig


@dataclass
class TurnStats:
    prompt_tokens: int  # whole history at the start of the turn, new message included
    prefilled_tokens: int  # tokens this turn actually fed through the model before decoding
    generated_tokens: int = 0
    finish_reason: str = ""
    ttft_ms: float = 0.0
    latency_ms: float = 0.0
    device_bytes: int = 0
    kept_tokens: int = 0
    readmitted_tokens: int = 0  # cold tokens promoted back to the device (per layer and KV head)


@dataclass
class Feed:
    """What one turn fed the cache: a prefill of ``prefill`` tokens (split for ``max_new``), then
    ``decodes`` decode steps (``app.engine.replay``)."""

    prefill: int
    max_new: int
    decodes: int = 0


@dataclass
class Session:
    """One conversation.

    ``token_ids`` is the whole conversation as the model sees it; the cache has been fed the
    first ``cache.history_len`` of them, and the rest (at most the closing of the last reply and
    the next user block) are fed by the next turn's prefill.
    """

    id: str
    mode: str
    rocket: RocketKVConfig
    cache: SessionCache | None
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)
    owner: str | None = None  # who may use the session (an API key's id); None: anyone with the id
    # A parked session (its cache dropped from the device to make room): the record its cache's
    # ``persist()`` wrote, restored at its next turn; None with no cache means re-prefill the history.
    parked_kv: dict | None = None
    # Parked by this engine to make room (its cache taken off a full device), until a cache comes back:
    # the service lets such a session go once Redis has its latest state, so a replica with room may take it.
    parked: bool = False
    # What the current cache was fed since it was created, turn by turn (an exact rebuild replays it).
    feeds: list[Feed] = field(default_factory=list)
    # The tokens a cache had been fed when part of it was lost (its cold pages gone with Redis), until a
    # cache holds them again: the next turn rebuilds it, replaying ``feeds`` where they account for them.
    # 0: nothing lost.
    lost_fed: int = 0
    # The last finished turn as its caller's retry gets it back ({"key", "text", "finish_reason",
    # "usage", "ttft_ms", "latency_ms", "replica"}): a turn sent again under the same idempotency key
    # is answered from here instead of running twice (``app.session_turns``). Kept for the service.
    last_turn: dict | None = None
    # The last persist of its cache failed (Redis took none of its KV generation): the record saved with it
    # names no KV, and the service saves again, with the KV, once Redis takes it.
    kv_unwritten: bool = False
    # The KV generation the session's record was last committed naming (from this process), or None: what
    # a cache dropped half-updated is restored from (``Engine.kv_settled``, ``_drop_if_broken``).
    stored_kv: dict | None = None
    busy: bool = False
    # Turns begun here, undone ones too: a save commits only a session no turn touched while it wrote.
    turns_begun: int = 0
    cancel_requested: bool = False
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)

    @property
    def fed_tokens(self) -> int:
        return self.cache.history_len if self.cache is not None else 0
