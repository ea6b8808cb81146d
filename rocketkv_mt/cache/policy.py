"""The two halves of a cache mode and what they see of the cache that composes them.

A mode is a prefill policy (which tokens stay on the device after a turn's prefill, and which set
decode reads) combined with a decode policy (how one decode query attends over that set). The
cache (``rocketkv_mt.cache.composed``) owns the device KV and the turn's sizes; each policy is a
small object holding only its own state. Each half also bounds the device bytes it can hold during
a turn (``TurnSize``), so the engine's memory model needs to know no mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rocketkv_mt.cache.base import CacheSpec
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.config import BudgetSplit
from tiers.base import Traffic
from tiers.cold.table import ColdResidency


@dataclass(frozen=True)
class TurnSize:
    """A turn as the memory model sees it before it runs, in tokens per KV head.

    fed: history the cache holds (its ``history_len``); kept: tokens it holds on the device now;
    new: tokens the turn's prefill feeds; total: fed + new + max new tokens; decode: the decode
    tokens the split reserves room for; split: the turn's sizes. token_bytes / layer_bytes: keys and
    values of one token over all layers / in one layer. chunked: the prefill is fed in chunks, so
    its new tokens sit in every layer until the last chunk (``SessionCache.undo_chunks``).
    cold_pages: the most live cold pages a KV head has in a layer (``SessionCache.cold_pages``), None
    when not known before the turn (a cache restored at its start from a record that does not say)."""

    fed: int
    kept: int
    new: int
    total: int
    decode: int
    split: BudgetSplit
    token_bytes: int
    layer_bytes: int
    chunked: bool = False
    cold_pages: int | None = None

    @property
    def kept_after(self) -> int:
        """Tokens a compressed set holds at the turn's end: the prompt budget (or more, if it held
        more already) plus the decode tokens."""
        return max(self.split.prompt_budget, self.kept) + self.decode

    @property
    def uncompressed_bytes(self) -> int:
        """Bytes of the new tokens before a prefill compresses them: in one layer at a time (each
        layer's prefill compresses it before the next layer's runs), or in every layer at once when
        the prefill is chunked (compression waits for its last chunk)."""
        return (self.token_bytes if self.chunked else self.layer_bytes) * self.new


class LayeredTurn(Protocol):
    """A later turn's prefill fed layer by layer, keys first (``ComposedCache.begin_layered``): ``begin``
    before a layer's store takes the turn's keys (without waiting once the prefill policy's
    ``previous_settled``); once it holds the whole turn, ``window`` with its window rows (Hq, w, d); then ``rows`` for each group of rows (Hq, r, d)
    in order, from turn row ``first_row``, giving their attention (Hq, r, d); then ``end``, before the
    next layer runs."""

    def begin(self, layer: int) -> None: ...

    def window(self, layer: int, q_win: torch.Tensor, scaling: float) -> None: ...

    def rows(self, layer: int, q: torch.Tensor, first_row: int) -> torch.Tensor: ...

    def end(self, layer: int) -> None: ...


class CacheState(Protocol):
    """What a policy reads and updates of the cache that composes it."""

    spec: CacheSpec
    layers: list[LayerKV]
    history_len: int
    split: BudgetSplit | None
    traffic: Traffic
    readmitted: int  # cold token slots promoted back this turn, over all layers and KV heads
    broken: bool  # set by a policy whose change failed half-way (``SessionCache.broken``)

    def positions(self, n_new: int) -> torch.Tensor: ...

    def selected(self, layer: int, store: LayerKV, scores: torch.Tensor | None) -> None:
        """A layer's decode set is now ``store``; ``scores`` (Hkv, kept), in store order: what Stage 1
        scored its tokens this turn, or None when nothing was selected."""
        ...


class DecodePolicy(Protocol):
    """How a decode query attends over the set its prefill policy chose."""

    def __init__(self, spec: CacheSpec) -> None: ...

    def prepare(self, layer: int, store: LayerKV, scores: torch.Tensor | None, split: BudgetSplit, lead: int) -> None:
        """A layer's decode set was (re)chosen; see ``CacheState.selected``. What it builds for decode
        has room for the first step with ``lead`` tokens to spare (``LayerKV.reserve``)."""
        ...

    def attend(self, layer: int, q: torch.Tensor, store: LayerKV, split: BudgetSplit, scaling: float) -> torch.Tensor:
        """One decode query (Hq, 1, d) over ``store`` (its newest token is the one decoded) -> (Hq, 1, d)."""
        ...

    def target(self, layer: int, store: LayerKV, split: BudgetSplit, mirror: LayerKV | None, lead: int) -> DecodeTarget:
        """The step ``attend`` would run, as one session's row of a batched decode: ``store`` does not
        hold the token yet (the kernel appends it, to ``mirror`` too where there is one); the stores
        grow ``lead`` tokens early (``LayerKV.reserve``)."""
        ...

    def nbytes(self) -> int:
        """Device bytes this policy holds besides the KV."""
        ...

    @staticmethod
    def bound(turn: TurnSize, decode_tokens: int) -> int:
        """Upper bound of ``nbytes`` during a turn whose decode set grows to ``decode_tokens``."""
        ...


class PrefillPolicy(Protocol):
    """What a turn's prefill keeps on the device and which set decode reads.

    The lifecycle hooks have empty defaults, and decode reads the layer store unless a policy says
    otherwise: a policy that keeps nothing off the device, and selects at once, needs none of them."""

    cache: CacheState

    def __init__(self, cache: CacheState, tiers: TierContext | None) -> None: ...

    def attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """A layer's prefill queries (Hq, n, d), whose keys and values the layer's store already
        holds, attend; the policy then selects (``CacheState.selected``) -> (Hq, n, d)."""
        ...

    def select(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """Choose a layer's decode set after a prefill that kept nothing off the device (the layer's
        store holds the whole history, in order, the prefill's tokens last), from Stage 1's window
        queries q_win (Hq, w, d), the prefill's last w; ``attend`` does the same after attending. A
        prefill fed in chunks calls it on its own, some time after the last chunk, before the
        layer's next step (``ComposedCache``)."""
        ...

    def extend_decode_set(self, layer: int) -> LayerKV:
        """At a decode step of ``layer``, whose store already holds the token being decoded: add that
        token to the set decode reads, where the set is not the store itself, and return the set.
        By default decode reads the layer store itself."""
        return self.cache.layers[layer]

    def decode_set(self, layer: int) -> LayerKV | None:
        """The set ``extend_decode_set`` would return, before the token being decoded joins it (nor
        the layer store); None when the step has work ``before_step`` must do first, so it runs alone.
        By default the layer store."""
        return self.cache.layers[layer]

    @staticmethod
    def bound(turn: TurnSize, tiers: TierPolicy) -> int:
        """Upper bound of the KV bytes (layer stores, ``nbytes`` and prefill scratch) during ``turn``."""
        ...

    @staticmethod
    def decode_tokens(turn: TurnSize) -> int:
        """Upper bound of the decode set's length during ``turn``."""
        ...

    @staticmethod
    def cold_tokens_written(turn: TurnSize) -> int:
        """Upper bound of the tokens per KV head of one layer that ``turn`` writes to the cold tiers as new
        pages (the host room its admission holds); none where nothing is kept off the device."""
        return 0

    def begin_turn(self) -> None:
        """Before a turn's prefill, while ``CacheState.split`` is still the last turn's."""

    def chunkable(self) -> bool:
        """Whether the next prefill may be fed in chunks: its earlier chunks attend densely over the
        layer stores, which must then hold all that the whole prefill's queries would attend to."""
        return True

    @staticmethod
    def layers_later(tiers: TierPolicy) -> bool:
        """Whether a later turn's prefill (into a cache that holds history) that cannot be fed in chunks
        (``chunkable``) is fed layer by layer, its keys first (``layered_turn``), rather than whole."""
        return False

    def layered_turn(self) -> LayeredTurn | None:
        """What feeds this later turn layer by layer (``window``, ``rows``, ``end`` of each layer), where
        ``layers_later``; None otherwise."""
        return None

    def before_step(self, layer: int) -> None:
        """Before a layer's new keys and values are appended to its store."""

    def select_layered(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """A prompt fed layer by layer into a cache without history has been through ``layer``:
        ``select``, here by default; a policy may run it on the page reader while other sessions step,
        the next layer then waits for it (``previous_chosen``)."""
        self.select(layer, q_win, scaling)

    def previous_chosen(self, layer: int) -> None:
        """Before a prompt fed layer by layer starts ``layer``: the layer before it has selected (this
        waits for it where it runs on the page reader)."""

    def previous_settled(self, layer: int) -> bool:
        """Whether ``previous_chosen`` would not wait."""
        return True

    def settle(self) -> None:
        """Apply now what the last prefill left to apply at the next decode step (waiting for the page
        reader where part of it runs there). By default nothing is left."""

    def settled(self) -> bool:
        """Whether ``before_step`` would not wait for work on the page reader (a layer's choice still
        being applied there). By default nothing runs there."""
        return True

    def end_turn(self) -> None:
        """When a turn's reply is finished."""

    def nbytes(self) -> int:
        """Device bytes this policy holds besides the layer stores."""
        return 0

    def release(self) -> None:
        """Free what the session holds outside the device."""

    def persist(self) -> dict | None:
        """Write the KV to the tiers; a JSON-able record, or None where this policy keeps no KV there."""
        return None

    def restore(self, state: dict) -> bool:
        """Rebuild the stores from ``persist``'s record; False when that is not possible."""
        return False

    def cold_bytes(self) -> dict[str, int]:
        """Bytes of this session in the host tier and in Redis."""
        return {"host": 0, "redis": 0}

    def cold_tokens(self) -> int:
        """Tokens per KV head of the first layer held in the cold tiers."""
        return 0

    def cold_pages(self) -> int:
        """The most live cold pages one KV head has in one layer."""
        return 0

    def cold_residency(self, layer: int) -> ColdResidency | None:
        """Where a layer's cold tokens are (``tiers.cold.table``), for the memory map; None where this
        policy keeps no token off the device (a token it does not hold there is gone)."""
        return None
