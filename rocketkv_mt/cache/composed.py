"""The session cache of every mode: the device KV and the turn's sizes, with a prefill policy and a
decode policy (``rocketkv_mt.cache.policy``) deciding what stays and what each step reads.

A prefill fed in chunks (``rest`` > 0 until its last forward) reaches neither policy's attention:
every chunk, the last too, is appended to every layer and attends densely over all the layer holds
(which is what a whole prefill's queries attend to, in every mode that lets its prefill be split),
and ``undo_chunks`` takes the earlier chunks back. The chunks keep each layer's last queries, so
the window's are at hand after the last chunk however short it is;
the prefill policy then selects from the layer's store with them (``PrefillPolicy.select``, the
selection a whole prefill makes) later, layer by layer: in ``select_pending`` between the engine's
steps, or before the layer's next step at the latest.

A first turn may instead be fed layer by layer (``begin_layered``, ``app.engine.layer_prefill``): the
model runs one layer over the whole prompt, in groups of query rows, before the next layer. Each
group's keys and values join the layer's store and its queries attend densely over it (exactly what
the whole prefill's rows attend to); after the layer's last group the prefill policy selects with
the layer's window queries (``PrefillPolicy.select_layered``: ``tiered`` on a CPU hands that to the
page reader, and the next layer waits for it before it takes its first group), so a layer holds its
whole prompt only while it is the one running, or until its selection is done.
``undo_layered`` takes such a prefill back: the cache is empty again, as before it.

A later turn is fed layer by layer where the prefill policy says so (``PrefillPolicy.layered_turn``:
``tiered``, whose rows also attend over cold pages that the window rows pick): each layer takes the
whole turn's keys first (``layered_keys``), then its window rows (``layered_window``), then the rows
in groups. Taken back half way, the layers before had re-selected already: the cache is released and
marked broken, its history kept, so the session's next turn rebuilds it as it was (``app.engine.replay``).
"""
from __future__ import annotations

import time

import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.base import AttentionTimer, CacheBroken, CacheSpec, ForwardStep
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.cache.memory_map import MemoryMap, map_summary, memory_map
from rocketkv_mt.cache.mode import CacheMode
from rocketkv_mt.cache.policy import LayeredTurn
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.cache.tier_context import TierContext
from rocketkv_mt.config import BudgetSplit, RocketKVConfig
from tiers.base import Traffic


class ComposedCache:
    """A ``SessionCache`` of ``mode``: ``layers`` hold each layer's tokens on the device, ``prefill``
    and ``decode`` are the mode's policies (``tiers``: where cold tokens go, for the modes that keep any)."""

    def __init__(self, mode: CacheMode, spec: CacheSpec, rocket: RocketKVConfig | None = None,
                 tiers: TierContext | None = None):
        self.mode = mode.name
        self._mode, self._tiers = mode, tiers  # to start afresh (``undo_layered``)
        self.spec = spec
        self.rocket = rocket or RocketKVConfig()
        self.layers = self._fresh_layers()
        self.history_len = 0  # tokens fed so far == position of the next token
        self.step: ForwardStep | None = None
        self.split: BudgetSplit | None = None
        self.timer = AttentionTimer()
        self.traffic = Traffic()  # bytes this cache moved between tiers in its last turn
        self.readmitted = 0  # cold token slots promoted back this turn, over all layers and KV heads
        self.broken = False  # see ``SessionCache.broken``
        # While a chunked prefill is under way: the history length and split from before its first chunk.
        self._chunked_from: tuple[int, BudgetSplit | None] | None = None
        # After a chunked prefill's last chunk: layer -> (window queries (Hq, w, d), scaling) to select with.
        self._unselected: dict[int, tuple[torch.Tensor, float]] = {}
        # While it is under way: layer -> the last (up to w) queries its chunks have had so far, so that
        # the last chunk may be shorter than the window.
        self._window_tail: dict[int, torch.Tensor] = {}
        # While a prefill fed layer by layer is under way: per layer, the prompt's tokens it has had so far.
        self._layered: list[int] | None = None
        # A later turn fed layer by layer: the policy's part (None otherwise), and per layer the turn's
        # tokens whose keys and values its store holds (they come before its rows).
        self._later: LayeredTurn | None = None
        self._keyed: list[int] = []
        self.decode = mode.decode(spec)
        self.prefill = mode.prefill(self, tiers)

    # --- engine side -------------------------------------------------------------------------
    def begin_forward(self, n_new: int, *, prefill: bool, max_new: int = 0, rest: int = 0) -> None:
        self._usable()
        split = None
        if prefill:
            self.select_pending()  # with the split of the prefill that left it, before a new one is made
            if self._chunked_from is None:  # the prefill's first forward (its only one, unless chunked)
                self.prefill.begin_turn()
                self.readmitted = 0
                self.traffic.reset()
                if rest:
                    self._chunked_from = (self.history_len, self.split)
                    # The chunks append the whole turn to every layer: room for it now, so that no later
                    # chunk's step (which carries other sessions' decode tokens) copies the history to grow.
                    for store in self.layers:
                        store.reserve(store.length + n_new + rest)
            split = self.rocket.split(self.history_len + n_new + rest + max_new, max_new, self.spec.head_dim)
            self.split = split
        self.step = ForwardStep(n_new=n_new, prefill=prefill, max_new=max_new, split=split, rest=rest)

    def end_forward(self) -> None:
        assert self.step is not None
        self.history_len += self.step.n_new
        if self.step.prefill and not self.step.rest:
            self._chunked_from = None
        self.step = None

    def layers_later(self) -> bool:
        """Whether a later turn's prefill may be fed layer by layer (``begin_layered`` with history)."""
        return self.history_len > 0 and self.prefill.layered_turn() is not None

    def begin_layered(self, n_new: int, max_new: int = 0) -> None:
        """Start a prefill of ``n_new`` tokens fed layer by layer: from now until ``end_layered``,
        ``attend`` takes each layer's rows in groups (any number of tokens, in order). A later turn's
        layer takes the turn's keys and values first (``layered_keys``), then its window rows
        (``layered_window``)."""
        if self.step is not None:
            raise RuntimeError("a forward is under way")
        later = self.prefill.layered_turn() if self.history_len else None
        if self.history_len and later is None or not self.history_len and not self.prefill.chunkable():
            raise RuntimeError("this cache's next prefill cannot be fed layer by layer")
        self.begin_forward(n_new, prefill=True, max_new=max_new)
        self._layered = [0] * self.spec.num_layers
        self._later, self._keyed = later, [0] * self.spec.num_layers

    def end_layered(self) -> None:
        """Every layer has had the whole prompt (and selected): the prefill ends as a whole one does."""
        assert self.step is not None and self._layered is not None
        short = [i for i, fed in enumerate(self._layered) if fed != self.step.n_new]
        if short:
            raise RuntimeError(f"layers {short} have not had the whole prompt")
        self._layered, self._later = None, None
        self.end_forward()

    def layered_keys(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A later turn fed layer by layer: the keys and values (Hkv, r, d) of its next ``r`` tokens join
        the layer's store, before any of its rows attends."""
        fed, n, total = self._keyed[layer], k.shape[1], self.step.n_new
        if self._later is None or self._layered[layer] or fed + n > total:
            raise RuntimeError(f"layer {layer}: keys out of turn ({fed} + {n} of {total})")
        store = self.layers[layer]
        if fed == 0:
            self._later.begin(layer)
            store.reserve(store.length + total)  # the layer's turn, in place: no copy as it grows
        start = self.history_len + fed
        store.append(k, v, torch.arange(start, start + n, device=self.spec.device))
        self._keyed[layer] = fed + n

    def layered_ready(self, layer: int) -> bool:
        return self.prefill.previous_settled(layer)  # the layer before chosen, and applied: ``begin`` would not wait

    def layered_window_rows(self) -> int:
        """How many of the turn's last rows are its window (``layered_window``)."""
        return min(self.split.window_size, self.step.n_new)

    def layered_window(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """A later turn fed layer by layer: the layer's store holds the whole turn; its window rows
        (Hq, w, d) pick what its rows attend to besides the device, and Stage 1's choice."""
        if self._later is None or self._keyed[layer] != self.step.n_new:
            raise RuntimeError(f"layer {layer}: the window comes after the whole turn's keys")
        self._later.window(layer, q_win, scaling)

    @torch.inference_mode()
    def undo_layered(self) -> None:
        """Take back a prefill fed layer by layer (between two groups). A first turn's cache starts
        afresh, empty, as it was before it; what earlier layers demoted to the cold tiers is freed. A
        later turn's earlier layers re-selected already: the cache is released too, but keeps its history
        and is marked broken, so that the next turn rebuilds it from the history (``app.engine.replay``)."""
        if self._layered is None:
            return
        later, history = self._later is not None, self.history_len
        self._later = None
        self.prefill.release()
        self.layers = self._fresh_layers()
        self._layered, self.step, self.split, self.history_len, self.readmitted = None, None, None, 0, 0
        self._window_tail.clear()
        self.traffic.reset()
        self.decode = self._mode.decode(self.spec)
        self.prefill = self._mode.prefill(self, self._tiers)
        if later:
            self.history_len, self.broken = history, True

    def _fresh_layers(self) -> list[LayerKV]:
        return [LayerKV(self.spec.num_kv_heads, self.spec.head_dim, self.spec.dtype, self.spec.device)
                for _ in range(self.spec.num_layers)]

    def last_chunk_min(self) -> int | None:
        # The window's queries are gathered across chunks (``_window_tail``): a last chunk of one token will do.
        return 1 if self.prefill.chunkable() else None

    @torch.inference_mode()
    def undo_chunks(self) -> None:
        if self._chunked_from is None:
            return
        (history_len, split), self._chunked_from = self._chunked_from, None
        self._window_tail.clear()
        fed = self.history_len - history_len
        for store in self.layers:
            store.truncate(store.length - fed)
        self.history_len, self.split = history_len, split

    def positions(self, n_new: int) -> torch.Tensor:
        """Positions of the next n_new tokens: they continue the whole history, not the kept length."""
        return torch.arange(self.history_len, self.history_len + n_new, device=self.spec.device)

    def unselected_layers(self) -> int:
        return len(self._unselected)

    def decode_ready(self) -> bool:
        return self.prefill.settled()

    @torch.inference_mode()
    def settle(self) -> None:
        self._usable()
        self.select_pending()
        self.prefill.settle()

    @torch.inference_mode()
    def select_pending(self, deadline: float | None = None) -> int:
        for layer in sorted(self._unselected):
            self._select(layer)
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return len(self._unselected)

    def _select(self, layer: int) -> None:
        # The layer stays unselected until its selection is made: one that fails leaves the layer as it
        # was (or the cache broken), and the next ``select_pending`` tries again.
        q_win, scaling = self._unselected[layer]
        self.prefill.select(layer, q_win, scaling)
        del self._unselected[layer]

    # A turn's end and persisting settle the turn's re-selection in place (on tensors the model step made
    # under inference mode): they run as jobs, outside a step, so they enter the mode themselves.
    @torch.inference_mode()
    def end_turn(self) -> None:
        self._usable()
        self.select_pending()
        self.prefill.end_turn()

    def release(self) -> None:
        self._layered = None
        self._unselected.clear()
        self._window_tail.clear()
        self.prefill.release()

    @torch.inference_mode()
    def persist(self) -> dict | None:
        self._usable()  # a broken cache's KV must never reach Redis: a restore would bring it back
        if self.step is not None:  # between two chunks or slices: what the layers hold is no turn's end
            raise RuntimeError("a prefill is under way; persist after it")
        self.select_pending()
        state = self.prefill.persist()
        # ``cold_pages`` lets a parked session's next turn be bounded as tightly as a resident one's
        # (``app.engine.memory``): without it the bound assumes the most pages the history could fill.
        return None if state is None else {"history_len": self.history_len, "cold_pages": self.cold_pages(), **state}

    def _usable(self) -> None:
        if self.broken:
            raise CacheBroken("this cache was left half-updated by a failed change; rebuild the session")

    def restore(self, state: dict) -> bool:
        if not self.prefill.restore(state):
            return False
        self.history_len = int(state["history_len"])
        return True

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
        if self._layered is not None:
            return self._layered_attend(layer, q, k, v, scaling)
        if layer in self._unselected:
            self._select(layer)
        self.prefill.before_step(layer)
        self.layers[layer].append(k, v, self.positions(k.shape[1]))
        if self.step is not None and self.step.prefill:
            if self._chunked_from is not None:  # a chunk: nothing is selected until the prefill has ended
                store = self.layers[layer]
                out = dense_attention(q, store.keys, store.values, scaling)
                tail = self._window_with(layer, q)
                if self.step.rest:
                    self._window_tail[layer] = tail
                else:  # the last chunk: the window selects, later (``select_pending``)
                    self._unselected[layer] = (tail, scaling)
                return out
            return self.prefill_attention(layer, q, scaling)
        return self.decode_attention(layer, q, scaling)

    def _layered_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scaling: float) -> torch.Tensor:
        """A group of a layer's prompt rows, fed layer by layer: q (Hq, n, d) attend densely over all the
        layer holds with their keys; after the layer's last group it selects, with its window queries."""
        fed, n, total = self._layered[layer], k.shape[1], self.step.n_new
        if fed + n > total:
            raise ValueError(f"layer {layer}: {fed + n} of a {total}-token prompt fed")
        if self._later is not None:  # its keys and values are in the store already (``layered_keys``)
            if self._keyed[layer] != total:
                raise RuntimeError(f"layer {layer}: rows before the whole turn's keys")
            out = self._later.rows(layer, q, fed)
            self._layered[layer] = fed + n
            if fed + n == total:
                self._later.end(layer)
            return out
        store = self.layers[layer]
        if fed == 0:
            self.prefill.previous_chosen(layer)  # one layer holds the prompt at a time
            store.reserve(store.length + total)  # the layer's prompt, in place: no copy as it grows
        start = self.history_len + fed
        store.append(k, v, torch.arange(start, start + n, device=self.spec.device))
        out = dense_attention(q, store.keys, store.values, scaling)
        tail = self._window_with(layer, q)
        self._layered[layer] = fed + n
        if fed + n < total:
            self._window_tail[layer] = tail
        else:
            self.prefill.select_layered(layer, tail, scaling)
        return out

    def _window_with(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The layer's last (up to w) prefill queries once ``q`` (Hq, n, d) joins those kept from its
        earlier chunks or groups (taken out of ``_window_tail``; the caller keeps or uses the result)."""
        before = self._window_tail.pop(layer, None)
        tail = q if before is None or q.shape[1] >= self.split.window_size else torch.cat([before, q], dim=1)
        return self.split.window_of(tail).clone()

    def prefill_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """A turn's new queries (Hq, n, d) attend, then the prefill policy selects."""
        return self.prefill.attend(layer, q, scaling)

    def decode_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode query (Hq, 1, d) over the layer's decode set (the new token included)."""
        return self.decode.attend(layer, q, self.prefill.extend_decode_set(layer), self.split, scaling)

    def decode_target(self, layer: int) -> DecodeTarget | None:
        """``decode_attention``'s step as a row of a batched decode; the layer store takes the token
        too where the decode set is another store (a per-turn selection)."""
        store = None if layer in self._unselected else self.prefill.decode_set(layer)
        if store is None:
            return None
        full = self.layers[layer]
        return self.decode.target(layer, store, self.split, None if store is full else full, self._lead(layer))

    def _lead(self, layer: int) -> int:
        """How early the layer's stores grow at decode (``LayerKV.reserve``): layers grow on different steps."""
        return self.layers[layer].chunk * layer // self.spec.num_layers

    def selected(self, layer: int, store: LayerKV, scores: torch.Tensor | None) -> None:
        # Room for the first decode step's token with the layer's lead, made here, with the selection: a
        # selection leaves less spare than some layers' leads, which then all grew in that step.
        lead, full = self._lead(layer), self.layers[layer]
        store.reserve(store.length + 1, lead)
        if full is not store:  # the layer store beside a per-turn decode set takes the token too
            full.reserve(full.length + 1, lead)
        self.decode.prepare(layer, store, scores, self.split, lead)

    # --- accounting --------------------------------------------------------------------------
    def readmitted_tokens(self) -> int:
        return round(self.readmitted / (self.spec.num_layers * self.spec.num_kv_heads))

    def kept_tokens(self) -> int:
        return self.layers[0].length

    def cold_tokens(self) -> int:
        return self.prefill.cold_tokens()

    def cold_pages(self) -> int:
        return self.prefill.cold_pages()

    def device_bytes(self) -> int:
        """KV of the layer stores plus what each policy holds (a selection, KT pages, pages read back)."""
        return sum(layer.nbytes() for layer in self.layers) + self.prefill.nbytes() + self.decode.nbytes()

    def tier_bytes(self) -> dict[str, int]:
        return {"device": self.device_bytes(), **self.prefill.cold_bytes()}

    def memory_map(self, positions: int) -> MemoryMap:
        return memory_map(self.layers, self.prefill, self.history_len, positions)

    def map_summary(self, positions: int) -> dict[str, int]:
        return map_summary(self.layers, self.prefill, self.history_len, positions)
