"""What the engine sees of a session's cache (``SessionCache``), and the shapes every mode shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.cache.memory_map import MemoryMap
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit, RocketKVConfig
from tiers.base import Traffic


class CacheBroken(RuntimeError):
    """A cache a change failed half-way through (``SessionCache.broken``) was asked to go on."""


@dataclass(frozen=True)
class CacheSpec:
    """The model's attention shape and where the cache lives."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kernels: str = "auto"  # a ``rocketkv_mt.dispatch`` backend: "auto", "torch", "triton" or "native"


@dataclass
class ForwardStep:
    """What the next model forward feeds: ``n_new`` tokens, a turn's prefill or one decode token."""

    n_new: int
    prefill: bool
    max_new: int = 0
    split: BudgetSplit | None = None
    rest: int = 0  # tokens of the same prefill that later forwards feed (a prefill split into chunks)


@dataclass
class AttentionTimer:
    """Wall time spent inside attention (accumulated when enabled; synchronises CUDA to be exact)."""

    enabled: bool = False
    seconds: float = 0.0
    calls: int = field(default=0)


class SessionCache(Protocol):
    """A session's KV cache across all layers, kept between turns.

    The engine calls ``begin_forward`` before each model forward and ``end_forward`` after it; in
    between, the registered attention function calls ``attend`` once per layer with that layer's
    new queries/keys/values (keys after RoPE, at their true history positions).

    A turn's prefill may be split into chunks, one forward each (``rest`` > 0 until the last): the
    chunks before the last are appended to every layer uncompressed and attend densely over all the
    layer holds, so the last chunk finds what a whole prefill would have, and the mode's end of
    prefill (Stage 1 over the turn's window, KT, re-selection) runs once per layer, on the same
    inputs. Until the last chunk ``undo_chunks`` takes the chunks back. That end of prefill runs
    after the last chunk, layer by layer (``select_pending``), whenever the engine finds time
    between steps, and at the latest when the layer next steps: the first token comes from the
    last chunk, and the other sessions' steps are not held up by the whole history's selection.

    A first prompt may instead be fed layer by layer (``begin_layered`` .. ``end_layered``): the
    model runs each layer over the whole prompt, in groups of rows, before the next, and each layer
    selects after its last group, so only the running layer holds the whole prompt. The result is a
    whole prefill's; ``undo_layered`` takes it back (the cache is empty again).
    """

    mode: str
    spec: CacheSpec
    rocket: RocketKVConfig
    layers: list[LayerKV]  # the tokens each layer holds on the device
    history_len: int  # tokens fed so far == position of the next token
    split: BudgetSplit | None  # the current turn's sizes
    step: ForwardStep | None  # the forward in progress, between ``begin_forward`` and ``end_forward``
    timer: AttentionTimer
    traffic: Traffic  # bytes this cache moved between tiers in its last turn
    # Set when a change failed half-way (a re-selection that could not be applied whole nor left
    # undone): what it holds no longer accounts for its history, so it refuses every further turn,
    # end of turn and persist (``CacheBroken``); the engine drops it and rebuilds the session.
    broken: bool

    def begin_forward(self, n_new: int, *, prefill: bool, max_new: int = 0, rest: int = 0) -> None:
        """``rest``: tokens of this prefill that later forwards feed (0: this forward ends it)."""
        ...

    def end_forward(self) -> None: ...

    def begin_layered(self, n_new: int, max_new: int = 0) -> None:
        """Start feeding ``n_new`` tokens layer by layer (an empty cache's first prompt, or a later one
        where ``layers_later``): ``attend`` then takes each layer's rows in groups, in order, and selects
        after the layer's last one."""
        ...

    def end_layered(self) -> None:
        """Every layer has had the whole prompt: the prefill ends as a whole one does."""
        ...

    def layers_later(self) -> bool:
        """Whether this cache, holding history, feeds its next prefill layer by layer, each layer's keys
        first (``layered_keys``, then ``layered_window``, then the rows)."""
        ...

    def layered_keys(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A later turn fed layer by layer: the next keys and values (Hkv, r, d) of the turn in ``layer``."""
        ...

    def layered_window_rows(self) -> int:
        """How many of the turn's last rows are its window."""
        ...

    def layered_ready(self, layer: int) -> bool:
        """A prompt fed layer by layer: whether ``layer`` can start (take a later turn's keys, or a first
        prompt's first group) without waiting for the layer before it to have selected or applied its
        choice, which may run on the page reader."""
        ...

    def layered_window(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """A later turn fed layer by layer: the layer's window rows (Hq, w), once it holds the turn's keys."""
        ...

    def undo_layered(self) -> None:
        """Take back a prefill fed layer by layer, between two groups: the cache is empty again (a later
        turn's: released, its history kept, marked ``broken``: rebuilt at the next turn)."""
        ...

    def last_chunk_min(self) -> int | None:
        """Fewest tokens the last forward of a chunked prefill must feed, or None when this cache's next
        prefill cannot be split without changing its result."""
        ...

    def undo_chunks(self) -> None:
        """Take back the chunks an unfinished chunked prefill has fed (between two forwards): the cache
        is as it was before the prefill's first chunk."""
        ...

    def positions(self, n_new: int) -> torch.Tensor:
        """Positions of the next n_new tokens: they continue the whole history, not the kept length."""
        ...

    def unselected_layers(self) -> int:
        """Layers whose end of prefill after a chunked prefill has not run yet."""
        ...

    def select_pending(self, deadline: float | None = None) -> int:
        """Run the end of prefill of the unselected layers, in order, at least one, until
        ``time.perf_counter()`` passes ``deadline`` (None: all); returns the layers still left."""
        ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (1, Hq, n, d), k/v (1, Hkv, n, d) for the new tokens -> attention output (1, n, Hq, d)."""
        ...

    def decode_target(self, layer: int) -> DecodeTarget | None:
        """This layer's decode step as one session's part of a batched step (``rocketkv_mt.cache.decode_target``),
        the same computation as ``attend`` would do; None when the step must run alone (``attend``)."""
        ...

    def settle(self) -> None:
        """What the last prefill left to select or apply (part of it maybe on the page reader), done now
        rather than at the next decode step: before a cache is measured or copied outside the engine."""
        ...

    def decode_ready(self) -> bool:
        """Whether the next decode step would not wait for work on the page reader (a layer's choice
        still being made there, or being applied there after a prefill fed layer by layer): the
        batcher holds the session's decode, and jobs on the cache, back until then, while others step."""
        ...

    def end_turn(self) -> None:
        """Called by the engine when a turn's reply is finished."""
        ...

    def release(self) -> None:
        """Free whatever the session holds outside the device (called when the session is dropped)."""
        ...

    def persist(self) -> dict | None:
        """Write the KV to Redis and return a JSON-able record of it; None where the mode keeps no KV there."""
        ...

    def restore(self, state: dict) -> bool:
        """Rebuild from ``persist``'s record; False when that is not possible (the history is re-prefilled)."""
        ...

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of this session per tier: ``device``, ``host``, ``redis``."""
        ...

    def device_bytes(self) -> int:
        """Bytes the session holds on the device (what the mode's ``device_bound`` bounds)."""
        ...

    def kept_tokens(self) -> int:
        """Tokens per KV head held on the device (first layer; every layer holds the same count)."""
        ...

    def readmitted_tokens(self) -> int:
        """Tokens re-admitted from the cold tiers this turn, per layer and KV head on average."""
        ...

    def cold_tokens(self) -> int:
        """Tokens per KV head of the first layer held in the cold tiers."""
        ...

    def cold_pages(self) -> int:
        """The most cold pages holding a cold token that one KV head has in one layer (0: none)."""
        ...

    def memory_map(self, positions: int) -> MemoryMap:
        """Where each of a conversation's ``positions`` tokens is, per layer and KV head
        (``rocketkv_mt.cache.memory_map``): bookkeeping only, no KV read."""
        ...

    def map_summary(self, positions: int) -> dict[str, int]:
        """``memory_map(positions).summary()``, counted without building the map."""
        ...
