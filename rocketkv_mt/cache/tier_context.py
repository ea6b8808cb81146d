"""Where a session keeps the tokens its device set does not hold, and how a turn reads them back.

Every cache is made with a ``TierContext``; the modes whose prefill keeps nothing off the device
ignore it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tiers.codec import PageCodec, RawCodec
from tiers.host.tier import HostTier
from tiers.session_kv import SessionKV
from tiers.transfers import Transfers


@dataclass(frozen=True)
class TierPolicy:
    """How cold tokens are paged and read back, the same for every session of an engine.

    page_tokens: cold tokens per page of one KV head (the unit that moves and has a digest).
    prefill_attention: the turn's tokens attend over everything the turn read (``dense``) or over
    the new primary set (``selected``). reselect: a turn reads every cold page (``exhaustive``) or
    the pages whose digests rank highest (``digest``). candidates: cold tokens' worth of pages a
    ``digest`` turn reads per KV head, as a fraction of the prompt budget. page_grouping: with ``digest``, a demotion's tokens share pages
    with the tokens whose keys are nearest (``keys``) or with their neighbours in the text
    (``position``; ``exhaustive`` reads every page, so it always pages by position). sketch_bits:
    with ``digest``, bits per channel of every cold token's key sketch (``tiers.cold.key_sketch``; 0: none),
    by which a turn runs Stage 1 over the sketched tokens of a pool of pages (``sketch_pool`` times
    the candidates, those whose bounds rank highest) before reading a page. standin: with a sketch, the
    pool pages a turn does not read join its window rows' attention through their sketched keys and
    mean values (``rocketkv_mt.standin``). read_whole: a ``digest`` layer whose live cold pages are at
    most this many times the candidates is read whole, as ``exhaustive`` reads it (0: never). codec:
    how pages are stored."""

    page_tokens: int = 32
    prefill_attention: Literal["dense", "selected"] = "dense"
    reselect: Literal["digest", "exhaustive"] = "digest"
    candidates: float = 1.0
    page_grouping: Literal["keys", "position"] = "position"
    sketch_bits: int = 4
    sketch_pool: float = 4.5
    standin: bool = True
    read_whole: float = 1.5
    codec: PageCodec = field(default_factory=RawCodec)

    @property
    def pages_by_keys(self) -> bool:
        """Whether demoted tokens are paged by their keys: only ``digest`` ranks pages, so only it gains."""
        return self.reselect == "digest" and self.page_grouping == "keys"

    @property
    def sketched(self) -> int:
        """Bits of the key sketch cold tokens keep: only ``digest`` reads it."""
        return self.sketch_bits if self.reselect == "digest" else 0


@dataclass
class TierContext:
    """One session's place in the cold tiers: the host tier (which spills to Redis), its id there,
    the engine's ``TierPolicy``, and the engine's page reader (None: reads run inline)."""

    host: HostTier
    session_id: str
    policy: TierPolicy = field(default_factory=TierPolicy)
    transfers: Transfers | None = None

    @property
    def kv(self) -> SessionKV:
        """The session's KV in Redis (``tiers.session_kv``): where a persist writes and a restore reads."""
        return SessionKV(self.host, self.session_id)
