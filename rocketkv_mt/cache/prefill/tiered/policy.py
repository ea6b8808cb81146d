"""Re-select over the device and the cold tiers (``tiered``): the device holds only the primary set;
every other token of the history is cold, in the host tier or Redis. Each turn, layer by layer,
Stage 1 scores the history with the new window: selected cold tokens are promoted (re-admitted),
unselected primary tokens are demoted (docs/design.md, "The multi-turn rule" and "A turn, step by step").

Which cold tokens a turn scores is the ``reselect`` policy: ``exhaustive`` reads every cold page;
``digest`` ranks the cold pages by their key bounds (``rocketkv_mt.cold_select``) and reads only the
best ones, so a turn's traffic follows the prompt budget, not the history.

This module is the policy itself, which the cache modes register and ``ComposedCache`` calls through
the ``PrefillPolicy`` hooks: the turn's hooks, its split attention over the device and the pages read
back, when each layer's re-selection settles, what the policy holds, and persistence. The package's
other modules do the rest for it: which pages a turn reads (``reads``), the choice (``choice``), its
application (``apply``), a re-selection's states until it settles (``pending``), the memory bound
(``bounds``).
"""
from __future__ import annotations

from functools import partial

import torch

from rocketkv_mt.attention_ops import dense_attention, positional_attention
from rocketkv_mt.cache.policy import CacheState, PrefillPolicy
from rocketkv_mt.cache.prefill.tiered import bounds
from rocketkv_mt.cache.prefill.tiered.apply import reorganise
from rocketkv_mt.cache.prefill.tiered.choice import choose as choose_selection
from rocketkv_mt.cache.prefill.tiered.layered import TieredLayeredTurn
from rocketkv_mt.cache.prefill.tiered.pending import Choosing, Pending, Settling
from rocketkv_mt.cache.prefill.tiered.reads import ColdReads
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.dispatch import reselect
from rocketkv_mt.split_attention import attend_part, join_rows, merge
from rocketkv_mt.standin import beside
from tiers.cold.ids import PageNamer
from tiers.cold.layer import ColdLayer
from tiers.cold.table import ColdResidency
from tiers.session_kv import KVNotWritten, StoredLayer


class ReselectTiered(PrefillPolicy):
    """The ``tiered`` prefill policy of one session's cache: its cold layers (``cold``, one
    ``ColdLayer`` each), its reads (``reads``) and each layer's re-selection until it settles."""

    def __init__(self, cache: CacheState, tiers: TierContext | None) -> None:
        if tiers is None:
            raise ValueError("the tiered mode needs a TierContext (host tier and session id)")
        self.cache, self.tiers = cache, tiers
        spec, policy = cache.spec, tiers.policy
        self.namer = PageNamer()  # every layer's new pages of a turn share one store group
        self.cold = [
            ColdLayer(tiers.session_id, i, tiers.host, policy.page_tokens, policy.codec, spec.num_kv_heads,
                      spec.head_dim, spec.dtype,
                      by_keys=policy.pages_by_keys, sketch_bits=policy.sketched, namer=self.namer)
            for i in range(spec.num_layers)
        ]
        self._pending: list[Pending | Choosing | Settling | None] = [None] * spec.num_layers
        self.reads = ColdReads(cache, tiers, self.cold)
        self.layered = TieredLayeredTurn(self)  # a later turn fed layer by layer (``layered_turn``)

    # --- turns -------------------------------------------------------------------------------
    def begin_turn(self) -> None:
        self.reads.forget()
        self.settle()
        self.namer.next_batch()
        for cold in self.cold:  # the memory map's "moved by the last turn" starts here
            cold.new_turn()

    def chunkable(self) -> bool:
        # The cold pages a turn reads, and with ``selected`` what every new token attends to, follow
        # from the turn's last window: earlier chunks could not attend as the whole prefill does.
        return self.tiers.policy.prefill_attention != "selected" and not any(cold.has_pages() for cold in self.cold)

    @staticmethod
    def layers_later(tiers: TierPolicy) -> bool:
        # With ``selected`` every row attends to the turn's selection only, which the last window makes.
        return tiers.prefill_attention != "selected"

    def layered_turn(self) -> TieredLayeredTurn | None:
        # Nothing cold yet: the turn is fed in chunks, which can be taken back exactly.
        return self.layered if self.layers_later(self.tiers.policy) and not self.chunkable() else None

    def before_step(self, layer: int) -> None:
        if self._pending[layer] is not None:  # the first decode step: the turn's selection takes effect
            self._settle(layer)

    def end_turn(self) -> None:
        self.reads.drop()
        self.settle()

    def decode_set(self, layer: int) -> LayerKV | None:
        # The layer's first decode step of a turn settles its selection first (before_step): it runs alone.
        return None if self._pending[layer] is not None else self.cache.layers[layer]

    def attend(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        cache, policy = self.cache, self.tiers.policy
        store, cold, split = cache.layers[layer], self.cold[layer], cache.split
        n, q_win = q.shape[1], split.window_of(q)
        w = q_win.shape[1]
        total = cache.history_len + n
        if not cold.has_pages():
            self.previous_chosen(layer)
            out = dense_attention(q, store.keys, store.values, scaling)
            if store.length <= split.prompt_budget:
                cache.selected(layer, store, None)
                return out
            self.select(layer, q_win, scaling)
            return self._selected_attention(layer, q, scaling) if policy.prefill_attention == "selected" else out
        # The device part first (primary set and the turn, the turn causal); its window rows rank the
        # cold pages, which are read while the other rows attend; the pages read back are the second
        # part; one exact softmax over both.
        kernels = cache.spec.kernels
        whole = self.reads.whole(layer)
        # The window rows' logits over a prefetched sketch need no normaliser: the page reader makes them
        # while this thread attends over the device (before it decodes the next layer's sketch).
        ahead = None if whole else self.reads.pool_logits_ahead(layer, q_win, scaling)
        self.reads.prefetch(layer + 1)
        window = attend_part(q_win, store.keys, store.values, scaling, w, own_tail=n, first_row=n - w, backend=kernels)
        self.previous_chosen(layer)
        read = partial(self.reads.candidates, layer, q_win, window, scaling, total, whole, ahead)
        transfers = self.tiers.transfers
        reading = transfers.start(read) if transfers is not None and transfers.pays(n > w) else None
        device = window
        if n > w:
            device = join_rows(attend_part(q[:, : n - w], store.keys, store.values, scaling, 0, own_tail=n,
                                           backend=kernels), window)
        cand, standin = transfers.wait(reading) if reading is not None else read()
        parts = [device]
        keys, values, visible = beside(cand, standin)
        if keys.shape[1]:
            parts.append(attend_part(q, keys, values, scaling, w, visible=visible, backend=kernels))
        out, lse = merge(parts, q.dtype)
        choose = partial(choose_selection, parts, lse, store.positions, store.length, cand, total, w, split, kernels)
        if policy.prefill_attention != "selected" and whole and self.settles_beside(layer):
            # A layer read whole holds every cold page one layer at a time, so it applies its choice at once:
            # chosen and applied on the page reader while this thread goes on, where that pays.
            self.settle_beside(layer, partial(self._choose_and_apply, layer, choose), cand)
        elif policy.prefill_attention == "selected" or whole:
            self.apply(layer, choose())
        elif transfers is not None and transfers.pays(True):
            # The first token needs only this attention: Stage 1's choice over it runs on the page reader
            # while this thread goes on with the next layer, which waits for it before reading its own
            # pages (so one layer's whole read is held at a time, as when chosen here).
            self._pending[layer] = Choosing(transfers.start(choose, reads_device=True), cand, transfers, choose)
        else:
            self._pending[layer] = choose()
        # Applying the choice (promote, demote, KT) waits for the layer's first decode step, holding
        # meanwhile only the tokens it promotes.
        return self._selected_attention(layer, q, scaling) if policy.prefill_attention == "selected" else out

    def select(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """Nothing cold yet (a first turn, or a history within the budget): the store holds the whole
        history in order, as SnapKV sees it; Stage 1 over it, the rest demoted."""
        cache = self.cache
        store, split = cache.layers[layer], cache.split
        if store.length <= split.prompt_budget:
            cache.selected(layer, store, None)
            return
        slots, positions, scores = reselect(
            q_win, store.keys, store.positions, None, store.length, split.prompt_budget, split.kernel_size, scaling,
            backend=cache.spec.kernels,
        )
        self._reorganise(layer, slots, positions, scores, None)

    def select_layered(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """A first prompt fed layer by layer: on a CPU the layer's Stage 1 and demotion (its pages'
        digests and sketches; 90 to 200 ms of one core for a 7k-token prompt, the streams' longest
        pause when run in the slice) run on the page reader; the next layer waits for them."""
        if self.settles_beside(layer, last_too=True):
            self.settle_beside(layer, partial(self.select, layer, q_win, scaling), ())
        else:
            self.select(layer, q_win, scaling)

    def previous_chosen(self, layer: int) -> None:
        """The layer before this one chosen (and applied, if that ran on the page reader), before this
        one reads pages or demotes: one layer's read is held at a time. After the turn has attended,
        the last layer may still run on the reader (its choice, or for a turn fed layer by layer its
        application); its first decode step waits for it (``before_step``), or is held back until it
        is done (``settled``)."""
        if layer:
            self._chosen(layer - 1)

    def _chosen(self, layer: int) -> None:
        """The layer's re-selection chosen, and applied where that runs on the page reader (waits for it)."""
        if self._pending[layer] is not None:
            self._pending[layer] = self._pending[layer].chosen()

    def settled(self) -> bool:
        return all(p is None or p.ready() for p in self._pending)

    def previous_settled(self, layer: int) -> bool:
        """Whether ``previous_chosen`` would not wait for the page reader."""
        pending = self._pending[layer - 1] if layer else None
        return pending is None or pending.ready()

    def _settle(self, layer: int) -> None:
        """Run a layer's pending re-selection on the keys its turn attended to (or wait for the page
        reader to have run it). Nothing is left pending, even when it fails: a re-selection applies
        whole or not at all (``_reorganise``), so a failed one leaves the layer as it was, the turn's
        tokens on the device beside the primary set for the next turn to select from, or the cache
        marked broken. A failed choice would only fail again."""
        pending, self._pending[layer] = self._pending[layer], None
        p = pending.chosen()
        if p is not None:
            self.apply(layer, p)

    def apply(self, layer: int, p: Pending) -> None:
        """Apply a chosen re-selection to the layer (``_reorganise``)."""
        self._reorganise(layer, p.slots, p.positions, p.scores, p.cand)

    def _choose_and_apply(self, layer: int, choose) -> None:
        self.apply(layer, choose())

    def settles_beside(self, layer: int, last_too: bool = False) -> bool:
        """Whether a layer applies its choice on the page reader (``settle_beside``), beside the next
        layer's work or other sessions' steps on this thread: on a CPU (the other core), for every layer
        but the last, unless ``last_too``. A whole prefill's first token follows its last layer in the
        same step, so nothing would go on beside it; a turn fed layer by layer hands its first token
        over and the other sessions step on while its last layer settles (``last_too``). On CUDA the
        application's kernels would allocate on the side stream what the main stream then keeps: it
        stays on this thread, whose launches are cheap."""
        transfers = self.tiers.transfers
        return (transfers is not None and not transfers.on_device_stream()
                and (last_too or layer + 1 < len(self.cold)))

    def settle_beside(self, layer: int, job, held: tuple) -> None:
        """Run ``job`` (the layer's choice applied, or chosen and applied) on the page reader; ``held``:
        the pages read that it holds until done. The next layer waits for it (``previous_chosen``)."""
        transfers = self.tiers.transfers
        self._pending[layer] = Settling(transfers.start(job), held, transfers)

    def settle(self) -> None:
        """Every layer's pending re-selection, now (before a new turn, at a turn's end, before persisting)."""
        for layer, pending in enumerate(self._pending):
            if pending is not None:
                self._settle(layer)

    def _selected_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """The turn's queries over the new primary set only (which keeps just some of the turn's tokens)."""
        store = self.cache.layers[layer]
        return positional_attention(q, self.cache.positions(q.shape[1]), store.keys, store.values, store.positions,
                                    None, scaling)

    def _reorganise(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor, cand) -> None:
        """Make the selection the layer's primary set, whole or not at all (``apply.reorganise``)."""
        self.reads.cold_set_changed(layer)
        reorganise(self.cache, self.cold[layer], layer, slots, positions, scores, cand)

    # --- memory ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """The pages read back and held until their layer settles, and a next layer's read once done."""
        return sum(p.nbytes() for p in self._pending if p is not None) + self.reads.nbytes() + self.layered.nbytes()

    # The memory model's bounds of a turn (``bounds``).
    bound = staticmethod(bounds.bound)
    decode_tokens = staticmethod(bounds.decode_tokens)
    cold_tokens_written = staticmethod(bounds.cold_tokens_written)

    def cold_tokens(self) -> int:
        return self.cold[0].alive_count()

    def cold_pages(self) -> int:
        return max(cold.live_page_count() for cold in self.cold)

    def cold_residency(self, layer: int) -> ColdResidency:
        # Between two slices of a turn fed layer by layer, the layer may still be applying its choice on
        # the page reader: its cold pages are read once that is done.
        self._chosen(layer)
        return self.cold[layer].residency()

    def cold_bytes(self) -> dict[str, int]:
        host, sid = self.tiers.host, self.tiers.session_id
        stored = host.store.session_bytes(sid) if host.store is not None else 0
        return {"host": host.session_bytes(sid), "redis": stored}

    def release(self) -> None:
        self.reads.forget()
        self.layered.drop()
        for pending in self._pending:  # what a step that failed left on the page reader ends first
            if pending is not None:
                pending.end()
        self._pending = [None] * len(self._pending)
        for cold in self.cold:
            cold.free()

    # --- persistence -------------------------------------------------------------------------
    def persist(self) -> dict | None:
        """Write a new KV generation (``tiers.session_kv``: new cold pages, page tables, the primary set)
        and return its reference with what checks it; None without a store. A write that failed (what it
        wrote is removed) raises ``KVNotWritten``: the caller's record then names no KV for now."""
        kv, cache = self.tiers.kv, self.cache
        if not kv.available:
            return None
        self.settle()
        layers = [StoredLayer(cold.page_ids(), cold.index_tensors(),
                              {"keys": store.keys, "values": store.values, "positions": store.positions})
                  for cold, store in zip(self.cold, cache.layers)]
        got = kv.write(layers)
        if got is None:
            raise KVNotWritten("the store did not take the KV generation")
        ref, written = got
        cache.traffic.redis_bytes_written += written
        return {**ref, "cold": [cold.snapshot() for cold in self.cold]}

    def restore(self, state: dict) -> bool:
        """Rebuild the primary set and the cold bookkeeping from the generation ``persist``'s record names,
        all or nothing: False (the cache left empty) when a part is missing, or when what was read does
        not hold each position of the history exactly once per KV head (``history_len``)."""
        kv = self.tiers.kv
        tables = kv.read(state) if kv.available else None
        if tables is None or len(tables) != len(self.cache.layers) or len(state.get("cold", [])) != len(tables):
            return False
        try:
            pages = self._restore_tables(tables, state["cold"], int(state["history_len"]))
        except (KeyError, TypeError, ValueError, RuntimeError):
            pages = None
        if pages is None or not kv.adopt(state, pages):
            self._reset_restored()
            return False
        self.namer.renew()  # new pages of the restored cache go under an epoch of its own
        return True

    def _restore_tables(self, tables: list, cold_states: list, history: int) -> list[str] | None:
        spec, pages = self.cache.spec, []
        for i, ((index, primary), store, cold) in enumerate(zip(tables, self.cache.layers, self.cold)):
            pages += cold.restore(cold_states[i], index)
            positions = primary["positions"]
            if positions.dim() != 2 or positions.shape[0] != len(cold.ids):
                return None
            for head, cold_pos in enumerate(cold.held_per_head()):
                held = torch.cat([positions[head].long(), cold_pos])
                if held.numel() != history or not torch.equal(held.sort().values, torch.arange(history)):
                    return None
            store.replace(primary["keys"].to(spec.device, spec.dtype), primary["values"].to(spec.device, spec.dtype),
                          positions.to(spec.device))
        return pages

    def _reset_restored(self) -> None:
        """Undo a restore that did not complete: nothing was adopted, so only the bookkeeping goes."""
        for store in self.cache.layers:
            store.truncate(0)
        for cold in self.cold:
            cold.clear()
