"""The session cache interface that every cache mode implements."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit, RocketKVConfig
from tiers.base import Traffic


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


class SessionCache(ABC):
    """A session's KV cache across all layers, kept between turns.

    The engine calls ``begin_forward`` before each model forward and ``end_forward`` after it; in
    between, the registered attention function calls ``attend`` once per layer with that layer's
    new queries/keys/values (keys after RoPE, at their true history positions).

    A turn's prefill may be split into chunks, one forward each (``rest`` > 0 until the last): the
    chunks before the last are appended to every layer uncompressed and attend densely over all the
    layer holds, so the last chunk finds what a whole prefill would have, and the mode's end of
    prefill (Stage 1 over the turn's window, KT, re-selection) runs once, there. Until then
    ``undo_chunks`` takes the chunks back.
    """

    mode: str = "abstract"
    readmitted: int = 0  # cold token slots promoted back this turn, over all layers and KV heads (tiered)

    def __init__(self, spec: CacheSpec, rocket: RocketKVConfig | None = None):
        self.spec = spec
        self.rocket = rocket or RocketKVConfig()
        self.layers = [
            LayerKV(spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device) for _ in range(spec.num_layers)
        ]
        self.history_len = 0  # tokens fed so far == position of the next token
        self.step: ForwardStep | None = None
        self.split: BudgetSplit | None = None
        self.timer = AttentionTimer()
        self.traffic = Traffic()  # bytes this cache moved between tiers in its last turn (tiered modes)
        # While a chunked prefill is under way: the history length and split from before its first chunk.
        self._chunked_from: tuple[int, BudgetSplit | None] | None = None

    # --- engine side -------------------------------------------------------------------------
    def begin_forward(self, n_new: int, *, prefill: bool, max_new: int = 0, rest: int = 0) -> None:
        """``rest``: tokens of this prefill that later forwards feed (0: this forward ends it)."""
        split = None
        if prefill:
            if rest and self._chunked_from is None:
                self._chunked_from = (self.history_len, self.split)
            split = self.rocket.split(self.history_len + n_new + rest + max_new, max_new, self.spec.head_dim)
            self.split = split
        self.step = ForwardStep(n_new=n_new, prefill=prefill, max_new=max_new, split=split, rest=rest)

    def end_forward(self) -> None:
        assert self.step is not None
        self.history_len += self.step.n_new
        if self.step.prefill and not self.step.rest:
            self._chunked_from = None
        self.step = None

    def last_chunk_min(self) -> int | None:
        """Fewest tokens the last forward of a chunked prefill must feed (Stage 1 scores with its last
        queries), or None when this cache's next prefill cannot be split without changing its result."""
        return self.rocket.window_size

    @torch.inference_mode()
    def undo_chunks(self) -> None:
        """Take back the chunks an unfinished chunked prefill has fed (between two forwards): the cache
        is as it was before the prefill's first chunk."""
        if self._chunked_from is None:
            return
        (history_len, split), self._chunked_from = self._chunked_from, None
        fed = self.history_len - history_len
        for store in self.layers:
            store.truncate(store.length - fed)
        self.history_len, self.split = history_len, split

    def positions(self, n_new: int) -> torch.Tensor:
        """Positions of the next n_new tokens: they continue the whole history, not the kept length."""
        return torch.arange(self.history_len, self.history_len + n_new, device=self.spec.device)

    # --- attention side ----------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (1, Hq, n, d), k/v (1, Hkv, n, d) for the new tokens -> attention output (1, n, Hq, d)."""
        if not self.timer.enabled:
            return self._attend(layer, q[0], k[0], v[0], scaling).transpose(0, 1).unsqueeze(0)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        t0 = time.perf_counter()
        out = self._attend(layer, q[0], k[0], v[0], scaling)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        self.timer.seconds += time.perf_counter() - t0
        self.timer.calls += 1
        return out.transpose(0, 1).unsqueeze(0)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (Hq, n, d); k, v (Hkv, n, d) -> (Hq, n, d)."""
        self.layers[layer].append(k, v, self.positions(k.shape[1]))
        if self.step is not None and self.step.prefill:
            if self.step.rest:  # a chunk before the last: nothing is compressed until the prefill ends
                store = self.layers[layer]
                return dense_attention(q, store.keys, store.values, scaling)
            return self.prefill_attention(layer, q, scaling)
        return self.decode_attention(layer, q, scaling)

    def prefill_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """A turn's new queries (Hq, n, d) attend densely to everything held, then the cache reorganises."""
        store = self.layers[layer]
        out = dense_attention(q, store.keys, store.values, scaling)
        self.after_prefill(layer, q, scaling)
        return out

    def decode_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of one decode query (Hq, 1, d) over the layer's kept tokens (new one included)."""
        store = self.layers[layer]
        return dense_attention(q, store.keys, store.values, scaling)

    @abstractmethod
    def after_prefill(self, layer: int, q: torch.Tensor, scaling: float) -> None:
        """Called once per layer at the end of a turn's prefill, with the turn's queries (Hq, n, d)."""

    def end_turn(self) -> None:
        """Called by the engine when a turn's reply is finished (tiered caches persist here)."""

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of this session per tier."""
        return {"device": self.device_bytes(), "host": 0, "redis": 0}

    def release(self) -> None:
        """Free whatever the session holds outside the device (called when the session is deleted)."""

    def persist(self) -> dict | None:
        """Write the KV to Redis and return a JSON-able record of it; None where the mode keeps no KV there."""
        return None

    def restore(self, state: dict) -> bool:
        """Rebuild from ``persist``'s record; False when that is not possible (the history is re-prefilled)."""
        return False

    # --- accounting --------------------------------------------------------------------------
    def readmitted_tokens(self) -> int:
        """Tokens re-admitted from the cold tiers this turn, per layer and KV head on average."""
        return round(self.readmitted / (self.spec.num_layers * self.spec.num_kv_heads))

    def kept_tokens(self) -> int:
        """Tokens per KV head held on the device (first layer; every layer holds the same count)."""
        return self.layers[0].length

    def device_bytes(self) -> int:
        """Bytes of KV (and KT, where kept) the session holds on the device."""
        return sum(layer.nbytes() for layer in self.layers)
