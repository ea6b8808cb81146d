"""Re-select over the device and the cold tiers (``tiered``): the device holds only the primary set;
every other token of the history is cold, in the host tier or Redis. Each turn, layer by layer,
Stage 1 scores the history with the new window: selected cold tokens are promoted (re-admitted),
unselected primary tokens are demoted (docs/design.md, "The multi-turn rule" and "A turn, step by step").

Which cold tokens a turn scores is the ``reselect`` policy: ``exhaustive`` reads every cold page;
``digest`` ranks the cold pages by their key bounds (``rocketkv_mt.cold_select``) and reads only the
best ones, so a turn's traffic follows the prompt budget, not the history.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from rocketkv_mt.attention_ops import dense_attention, positional_attention
from rocketkv_mt.cache.policy import CacheState, PrefillPolicy, TurnSize
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.cold_select import (
    candidate_pages,
    page_bounds,
    page_picks,
    pages_per_head,
    pool_logits,
    sketch_dtype,
)
from rocketkv_mt.dispatch import choose_over_parts, reselect
from rocketkv_mt.split_attention import Part, attend_part, join_rows, merge, window_probs
from rocketkv_mt.standin import StandIn, beside, standin_pages
from rocketkv_mt.take_rows import take_rows
from tiers.base import batch_nbytes
from tiers.cold_layer import ColdLayer, Sketched
from tiers.residency import ColdResidency


def read_bytes(cand: tuple) -> int:
    """Bytes of the keys and values of read-back tokens (``cand``'s first two tensors)."""
    return sum(t.numel() * t.element_size() for t in cand[:2])


@dataclass
class Pending:
    """A layer's re-selection, chosen but not applied: ``slots`` (Hkv, kept) into [device slots,
    ``cand``'s slots], their positions and Stage-1 scores, and ``cand`` (keys, values (Hkv, M, d),
    positions, alive, cold slots (Hkv, M)): only the read-back tokens the selection promotes."""

    slots: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    cand: tuple

    def nbytes(self) -> int:
        return read_bytes(self.cand)

    def chosen(self) -> "Pending":
        return self

    def end(self) -> None:
        """Let work on the page reader end, its result dropped (nothing runs for a chosen selection)."""


@dataclass
class Choosing:
    """A layer's re-selection still being chosen on the page reader (the model thread goes on with the
    next layer meanwhile): ``future`` gives the ``Pending``; ``cand``, every page the layer read, is
    held until then."""

    future: object  # concurrent.futures.Future of a Pending
    cand: tuple
    transfers: object  # the Transfers that runs it
    # The job and so every tensor it reads, kept until ``chosen``: on CUDA its kernels run on the side
    # stream after the job returns, and what the model thread frees meanwhile could be reused under them.
    job: object

    def nbytes(self) -> int:
        return read_bytes(self.cand)

    def chosen(self) -> Pending:
        return self.transfers.wait(self.future)

    def end(self) -> None:
        self.future.exception()


@dataclass
class Settling:
    """A layer's re-selection being chosen and applied on the page reader (Stage 1's choice, promote,
    demote, the decode set) while the model thread goes on with the next layer, which waits for it
    before reading its own pages: ``chosen`` hands over nothing left to apply. ``cand``, every page
    the layer read, is held until then."""

    future: object  # concurrent.futures.Future of the application
    cand: tuple
    transfers: object

    def nbytes(self) -> int:
        return read_bytes(self.cand)

    def chosen(self) -> None:
        self.transfers.wait(self.future)
        return None

    def end(self) -> None:
        self.future.exception()


def promoted_only(slots: torch.Tensor, device_slots: int, cand: tuple) -> tuple[torch.Tensor, tuple]:
    """Keep of the read-back tokens ``cand`` only those a selection ``slots`` (Hkv, kept) promotes:
    (the selection's slots into [device slots, the kept ones], the kept read-back tokens), each head
    padded with dead slots to the largest count. What a layer holds until it settles is then its
    promotions, not every page it read."""
    from_cold = slots >= device_slots
    m = int(from_cold.sum(dim=1).max()) if from_cold.numel() else 0
    order = torch.argsort((~from_cold).to(torch.int8), dim=1, stable=True)[:, :m]  # promotions first, in order
    picked = torch.gather((slots - device_slots).clamp(min=0), 1, order)
    valid = torch.gather(from_cold, 1, order)
    kept = (take_rows(cand[0], picked), take_rows(cand[1], picked), torch.gather(cand[2], 1, picked),
            torch.gather(cand[3], 1, picked) & valid, torch.where(valid, torch.gather(cand[4], 1, picked), -1))
    rank = torch.cumsum(from_cold.long(), dim=1) - 1
    return torch.where(from_cold, device_slots + rank, slots), kept


# A pool's pages per head are padded (with -1: dead slots) to a multiple of this: on a CPU the oneDNN
# product of a bfloat16 sketch builds a kernel for every new shape (about a millisecond each here), and
# padded pools repeat a few shapes across layers and turns.
POOL_PAGES_STEP = 16


def whole_limit(tiers: TierPolicy, prompt_budget: int) -> int:
    """The most live cold pages (of any KV head) a layer may have to be read whole (``reads_whole``)."""
    return int(tiers.read_whole * pages_per_head(tiers.candidates, prompt_budget, tiers.page_tokens))


def reads_whole(tiers: TierPolicy, cold_pages: int, prompt_budget: int) -> bool:
    """Whether a layer with ``cold_pages`` live cold pages (the most of any KV head) is read whole, as
    ``exhaustive`` reads it, and settled at once: a cold set of at most ``read_whole`` times the pages a
    ``digest`` turn reads costs less to read than to rank, and a layer settled at once holds its pages
    only while it computes, where a deferred one holds its promotions until the first decode step (a
    short turn's bound is then about half as large)."""
    if tiers.reselect == "exhaustive":
        return True
    return cold_pages <= whole_limit(tiers, prompt_budget)


def pages_of(pool: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """The cold pages (Hkv, k) that ``picked`` (Hkv, k), columns of ``pool`` (Hkv, n), name; -1 stays -1."""
    return torch.where(picked >= 0, torch.gather(pool, 1, picked.clamp(min=0)), -1)


def padded_pool(pages: torch.Tensor) -> torch.Tensor:
    """Pages (Hkv, n), -1 padded, widened with -1 to a multiple of ``POOL_PAGES_STEP`` columns."""
    pad = -pages.shape[1] % POOL_PAGES_STEP
    return torch.nn.functional.pad(pages, (0, pad), value=-1) if pad else pages


class ReselectTiered(PrefillPolicy):
    def __init__(self, cache: CacheState, tiers: TierContext | None) -> None:
        if tiers is None:
            raise ValueError("the tiered mode needs a TierContext (host tier and session id)")
        self.cache, self.tiers = cache, tiers
        spec, policy = cache.spec, tiers.policy
        self.cold = [
            ColdLayer(tiers.session_id, i, tiers.host, policy.page_tokens, policy.codec, spec.num_kv_heads,
                      spec.head_dim, spec.dtype,
                      by_keys=policy.pages_by_keys, sketch_bits=policy.sketched)
            for i in range(spec.num_layers)
        ]
        self._pending: list[Pending | Choosing | Settling | None] = [None] * spec.num_layers
        # A layer's whole pool of sketched pages and the worker's decode of it, started while the layer
        # before it computes (``_prefetch_sketch``): its estimated keys do not depend on the queries.
        self._sketches: list[tuple[torch.Tensor, object] | None] = [None] * spec.num_layers
        self._sketch_dtype = sketch_dtype(spec.device, spec.dtype)
        # A layer read whole (``reads_whole``): its pages, read on the page reader while the layer before
        # it computes (``_prefetch_read``); they do not depend on the queries either.
        self._reads: list[object | None] = [None] * spec.num_layers
        # Per layer, whether this turn reads it whole (``_reads_whole``), known until its cold set changes:
        # asked when the layer before prefetches its sketch and again when it attends.
        self._whole: list[bool | None] = [None] * spec.num_layers

    # --- turns -------------------------------------------------------------------------------
    def begin_turn(self) -> None:
        self._whole = [None] * len(self._whole)
        self._drop_prefetched()
        self.settle()
        for cold in self.cold:  # the memory map's "moved by the last turn" starts here
            cold.new_turn()

    def chunkable(self) -> bool:
        # The cold pages a turn reads, and with ``selected`` what every new token attends to, follow
        # from the turn's last window: earlier chunks could not attend as the whole prefill does.
        return self.tiers.policy.prefill_attention != "selected" and not any(cold.has_pages() for cold in self.cold)

    def before_step(self, layer: int) -> None:
        if self._pending[layer] is not None:  # the first decode step: the turn's selection takes effect
            self._settle(layer)

    def end_turn(self) -> None:
        self._drop_prefetched()
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
            self._previous_chosen(layer)
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
        whole = self._reads_whole(layer)
        # The window rows' logits over a prefetched sketch need no normaliser: the page reader makes them
        # while this thread attends over the device (before it decodes the next layer's sketch).
        ahead = None if whole else self._pool_logits_ahead(layer, q_win, scaling)
        self._prefetch_sketch(layer + 1)
        self._prefetch_read(layer + 1)
        window = attend_part(q_win, store.keys, store.values, scaling, w, own_tail=n, first_row=n - w, backend=kernels)
        self._previous_chosen(layer)
        read = partial(self._read_candidates, layer, q_win, window, scaling, total, whole, ahead)
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
        choose = partial(self._choose, parts, lse, store.positions, store.length, cand, total, w)
        if policy.prefill_attention != "selected" and whole and self._settles_beside(layer):
            # A layer read whole holds every cold page one layer at a time, so it applies its choice at once:
            # chosen and applied on the page reader while this thread goes on, where that pays.
            self._pending[layer] = Settling(transfers.start(partial(self._choose_and_apply, layer, choose)), cand,
                                            transfers)
        elif policy.prefill_attention == "selected" or whole:
            self._apply(layer, choose())
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

    def _choose(self, parts: list[Part], lse: torch.Tensor, device_pos: torch.Tensor, device_slots: int, cand: tuple,
                total: int, w: int) -> Pending:
        """Stage 1's choice over the device slots and the read-back ones, from the window rows' mass in
        the merged softmax; of the read-back tokens only those it promotes are kept."""
        split = self.cache.split
        # The stand-in's slots weigh in the softmax, so in Stage 1's scores, but hold no slot to choose.
        probs = torch.cat([window_probs(part, lse) for part in parts], dim=1)
        probs = probs[:, : parts[0].window_probs.shape[-1] + cand[0].shape[1]]
        slots, positions, scores = choose_over_parts(probs, device_pos, cand[2], cand[3], total, w,
                                                     split.prompt_budget, split.kernel_size,
                                                     backend=self.cache.spec.kernels)
        if len(parts) > 1:
            slots, cand = promoted_only(slots, device_slots, cand)
        return Pending(slots, positions, scores, cand)

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

    def _previous_chosen(self, layer: int) -> None:
        """The layer before this one chosen (and applied, if that ran on the page reader), before this
        one reads pages or demotes: one layer's read is held at a time, and the chain of layers leaves
        nothing running on the reader once the last layer has attended."""
        if layer and self._pending[layer - 1] is not None:
            self._pending[layer - 1] = self._pending[layer - 1].chosen()

    def _settle(self, layer: int) -> None:
        """Run a layer's pending re-selection on the keys its turn attended to (or wait for the page
        reader to have run it). Nothing is left pending, even when it fails: a re-selection applies
        whole or not at all (``_reorganise``), so a failed one leaves the layer as it was, the turn's
        tokens on the device beside the primary set for the next turn to select from, or the cache
        marked broken. A failed choice would only fail again."""
        pending, self._pending[layer] = self._pending[layer], None
        p = pending.chosen()
        if p is not None:
            self._apply(layer, p)

    def _apply(self, layer: int, p: Pending) -> None:
        self._reorganise(layer, p.slots, p.positions, p.scores, p.cand)

    def _choose_and_apply(self, layer: int, choose) -> None:
        self._apply(layer, choose())

    def _settles_beside(self, layer: int) -> bool:
        """Whether a layer read whole applies its choice on the page reader, beside the next layer's
        work on this thread: on a CPU (the other core), for every layer but the last (which nothing
        after it in the step would wait for). On CUDA the application's kernels would allocate on the
        side stream what the main stream then keeps: it stays on this thread, whose launches are cheap."""
        transfers = self.tiers.transfers
        return (transfers is not None and not transfers.on_device_stream()
                and layer + 1 < len(self.cold))

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
        """Make the selection (slots (Hkv, kept) into [device slots, read-back slots]) the primary set:
        promote the cold tokens it took, demote the device tokens it left, rebuild the decode set.

        Whole or not at all: everything that may fail for want of room or a tier (the new primary set,
        the demoted tokens' pages written to the host tier) happens before anything changes, so such a
        failure leaves the layer as it was; then the page table, the store and the decode set change,
        by steps that fail only on a bug or a device out of memory. Should one fail all the same, the
        cache is half-updated and is marked broken, never to be used again."""
        cache = self.cache
        store, cold = cache.layers[layer], self.cold[layer]
        self._whole[layer] = None  # its cold set changes here
        t = store.length
        keys, values = store.keys, store.values
        from_cold = slots >= t
        promoted, readmitted = None, 0
        if cand is not None and cand[0].shape[1]:
            keys, values = torch.cat([keys, cand[0]], dim=1), torch.cat([values, cand[1]], dim=1)
            cold_slot = torch.gather(cand[4], 1, (slots - t).clamp(min=0))
            promoted, readmitted = torch.where(from_cold, cold_slot, -1), int(from_cold.sum())
        new_k, new_v = take_rows(keys, slots), take_rows(values, slots)
        kept = torch.zeros(slots.shape[0], t + 1, dtype=torch.bool, device=slots.device)
        kept.scatter_(1, torch.where(from_cold, t, slots), True)
        demoted = cold.stage_demotion(store.keys, store.values, store.positions, ~kept[:, :t])
        try:
            cold.commit(demoted)
            if promoted is not None:
                cold.promote(promoted)
            cache.readmitted += readmitted
            cache.traffic.bytes_demoted += demoted.written
            store.replace(new_k, new_v, positions)
            cache.selected(layer, store, scores)
        except BaseException:
            cache.broken = True
            raise

    def _reads_whole(self, layer: int) -> bool:
        if self._whole[layer] is None:
            policy, budget = self.tiers.policy, self.cache.split.prompt_budget
            # ``exhaustive`` reads every layer whole: no page count needed.
            self._whole[layer] = policy.reselect == "exhaustive" or reads_whole(
                policy, self.cold[layer].live_page_count(at_most=whole_limit(policy, budget)), budget)
        return self._whole[layer]

    def _pool_logits_ahead(self, layer: int, q_win: torch.Tensor, scaling: float):
        """Start the window rows' logits over the layer's prefetched sketch on the page reader
        (``cold_select.pool_logits``); None when no sketch was prefetched."""
        started, transfers = self._sketches[layer], self.tiers.transfers
        if started is None or transfers is None:
            return None
        decoding = started[1]
        return transfers.start(lambda: pool_logits(q_win, decoding.result().keys, scaling), reads_device=True)

    def _read_candidates(self, layer: int, q_win: torch.Tensor, window: Part, scaling: float, total: int,
                         whole: bool, ahead=None) -> tuple[tuple, StandIn | None]:
        """The cold pages this turn scores, read from the tiers: keys, values (Hkv, M, d), positions,
        alive, flat cold slots (Hkv, M); and, with a sketch and ``standin``, the unread pages that carry
        the most window mass (``rocketkv_mt.standin``), else None.
        ``whole`` (``reads_whole``): all pages with cold tokens; else the pages whose digests rank
        highest, a budgeted number per KV head. ``window``: the window rows' attention part over the device keys
        (its normaliser bounds the final one); ``total``: the history's length with the turn. Runs on
        the page reader's thread while the model thread attends with the other rows."""
        cache, policy = self.cache, self.tiers.policy
        cold, dev, split = self.cold[layer], cache.spec.device, cache.split
        if whole:
            started, self._reads[layer] = self._reads[layer], None
            return (self.tiers.transfers.wait(started) if started is not None else self._read_whole(layer)), None
        per_head = pages_per_head(policy.candidates, split.prompt_budget, policy.page_tokens)
        pool, sketch = self._take_sketch(layer) if cold.sketch_bits else (None, None)
        lse_dev = window.lse.reshape(cache.spec.num_kv_heads, -1)
        if pool is None:
            kmin, kmax, live, nbytes = cold.digests(dev)
            cache.traffic.digest_bytes_read += nbytes
            bounds = page_bounds(q_win, kmin, kmax, lse_dev, scaling)
            if not cold.sketch_bits:
                return cold.fetch(candidate_pages(bounds, live, per_head), dev, cache.traffic), None
            # The pages whose bounds rank highest are the pool whose sketches are read; Stage 1 over
            # the device and the pool's sketched tokens then says which of them to read.
            pool = padded_pool(candidate_pages(bounds, live, self._pool_pages()))
            sketch = self._sketch(layer, pool, bounds_read=True)
        pool = pool.to(dev)
        cache.traffic.digest_bytes_read += sketch.nbytes
        logits = self.tiers.transfers.wait(ahead) if ahead is not None else None
        scores = page_picks(q_win, window, sketch.keys, sketch.positions, sketch.alive, cache.layers[layer].positions,
                            total, split.prompt_budget, split.kernel_size, scaling, policy.page_tokens,
                            logits=logits, backend=cache.spec.kernels)
        chosen = candidate_pages(scores.ranks, pool >= 0, per_head)
        cand = cold.fetch(pages_of(pool, chosen), dev, cache.traffic)
        return cand, self._standin(layer, pool, chosen, scores.mass, sketch, per_head)

    def _standin(self, layer: int, pool: torch.Tensor, chosen: torch.Tensor, mass: torch.Tensor, sketch: Sketched,
                 count: int) -> StandIn | None:
        """The ``count`` unread pool pages per KV head with the most window mass, their sketched keys
        and values (``rocketkv_mt.standin``); None when off or not sketched."""
        if not self.tiers.policy.standin:
            return None
        cold, p = self.cold[layer], self.tiers.policy.page_tokens
        read = torch.zeros(pool.shape[0], pool.shape[1] + 1, dtype=torch.bool, device=pool.device)
        read.scatter_(1, torch.where(chosen >= 0, chosen, pool.shape[1]), True)  # padding marks a spare column
        picked = standin_pages(mass, (pool >= 0) & ~read[:, :-1], count)
        values = cold.sketched_values(self.cache.spec.device, pages_of(pool, picked)) if picked.shape[1] else None
        if values is None:
            return None
        self.cache.traffic.digest_bytes_read += values[1]
        slots = (picked.clamp(min=0).unsqueeze(-1) * p + torch.arange(p, device=picked.device)).flatten(1)
        alive = torch.gather(sketch.alive, 1, slots) & (picked >= 0).repeat_interleave(p, dim=1)
        keys = take_rows(sketch.keys, slots)
        return StandIn(keys, values[0], alive)

    def _sketch(self, layer: int, pool: torch.Tensor, bounds_read: bool = False) -> Sketched:
        """The pool's key sketches decoded (``ColdLayer.sketched``)."""
        return self.cold[layer].sketched(self.cache.spec.device, pool, self._sketch_dtype, bounds_read=bounds_read)

    def _pool_pages(self) -> int:
        """Pages per KV head whose sketches a turn scores: ``sketch_pool`` times those it fetches."""
        policy = self.tiers.policy
        per_head = pages_per_head(policy.candidates, self.cache.split.prompt_budget, policy.page_tokens)
        return math.ceil(per_head * policy.sketch_pool)

    def _whole_pool(self, layer: int) -> torch.Tensor | None:
        """The layer's live pages (Hkv, n), when the pool holds them all: then no bound ranks them and
        their sketches can be decoded before the layer's queries exist. None otherwise."""
        pages = self.cold[layer].live_pages()
        return padded_pool(pages) if pages.shape[1] <= self._pool_pages() else None

    def _prefetch_sketch(self, layer: int) -> None:
        """Start decoding the next layer's whole pool on the page reader's thread, beside this layer's
        attention (the two cores of a CPU, or the side stream of a GPU)."""
        policy, transfers = self.tiers.policy, self.tiers.transfers
        if (transfers is None or not policy.sketched or layer >= len(self.cold) or not self.cold[layer].has_pages()
                or self._reads_whole(layer)):
            return
        pool = self._whole_pool(layer)
        if pool is not None:
            self._sketches[layer] = (pool, transfers.start(partial(self._sketch, layer, pool)))

    def _take_sketch(self, layer: int) -> tuple[torch.Tensor | None, Sketched | None]:
        """The layer's pool and its decoded sketch: the prefetched ones, else (whole pool, decoded now)
        if the pool holds every live page, else (None, None)."""
        started, self._sketches[layer] = self._sketches[layer], None
        if started is not None:
            return started[0], self.tiers.transfers.wait(started[1])
        pool = self._whole_pool(layer)
        if pool is None:
            return None, None
        return pool, self._sketch(layer, pool)

    def _prefetch_read(self, layer: int) -> None:
        """Start reading the next layer's cold pages on the page reader's thread, beside this layer's
        attention, where that layer is read whole: in a prefill step of many sessions' short turns
        the read was a fifth of this thread's tiered work, and the page reader had time for it."""
        transfers = self.tiers.transfers
        if (transfers is None or layer >= len(self.cold) or not self.cold[layer].has_pages()
                or not self._reads_whole(layer)):
            return
        self._reads[layer] = transfers.start(partial(self._read_whole, layer))

    def _read_whole(self, layer: int) -> tuple:
        """Every page of the layer that holds a cold token, read back (``ColdLayer.fetch``)."""
        cold = self.cold[layer]
        return cold.fetch(cold.live_pages(), self.cache.spec.device, self.cache.traffic)

    def _drop_prefetched(self) -> None:
        """Let every decode and read still in flight finish (a turn that stopped between layers), then
        forget them: the next turn's pools and cold sets differ."""
        for started in self._sketches:
            if started is not None and started[1].exception() is None:  # a failed decode has nothing to hand over
                self.tiers.transfers.wait(started[1])
        for started in self._reads:
            if started is not None and started.exception() is None:
                self.tiers.transfers.wait(started)
        self._sketches = [None] * len(self._sketches)
        self._reads = [None] * len(self._reads)

    # --- memory ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """The pages read back and held until their layer settles, and a next layer's read once done."""
        held = sum(p.nbytes() for p in self._pending if p is not None)
        return held + sum(read_bytes(r.result()) for r in self._reads
                          if r is not None and r.done() and r.exception() is None)

    @staticmethod
    def bound(turn: TurnSize, tiers: TierPolicy) -> int:
        """The primary set as ``EvictOnce`` bounds it, plus what a turn reads back: every cold page of
        one layer (keys and values) at a time when every layer is read whole (``reads_whole``); else
        the pages of every layer, held until its first decode step settles the selection, plus one
        layer's digests and scratch."""
        kv = turn.token_bytes * turn.kept_after + turn.uncompressed_bytes
        if tiers.reselect == "exhaustive" and turn.cold_pages is None:
            return kv + turn.layer_bytes * 2 * (turn.fed + turn.new)
        if turn.cold_pages is not None and reads_whole(tiers, turn.cold_pages, turn.split.prompt_budget):
            # One layer's device keys and the pages it read, joined, and that layer's selection of them;
            # and the next layer's pages, read meanwhile (``_prefetch_read``).
            return kv + turn.layer_bytes * 2 * (turn.kept + 2 * turn.cold_pages * tiers.page_tokens + turn.new)
        pages = pages_per_head(tiers.candidates, turn.split.prompt_budget, tiers.page_tokens)
        # A sketch's scratch: the pool's estimated keys (float32 at most), the logits of up to 2d window
        # rows at a time over them (``page_picks``; bfloat16 where the keys are) and the next layer's
        # pool being decoded (its codes widened to table indices, its keys in float32, then rounded):
        # with the torch path's float32 shares of a chunk, at most 24 * Hkv * d bytes a pool token and
        # its masks: 6 tokens' keys and values of one layer in a 16-bit model, 3 in a 32-bit one. The
        # stand-in (``rocketkv_mt.standin``) adds as many tokens as the pages read: their gathered keys and
        # decoded values in float32 (2 tokens' keys and values of one layer each in a 16-bit model), then
        # joined with the pages read into one part (a copy of both: 2 more).
        pool_pages = min(math.ceil(turn.fed / tiers.page_tokens), math.ceil(pages * tiers.sketch_pool))
        pool = (pool_pages + -pool_pages % POOL_PAGES_STEP) * tiers.page_tokens  # padded (``padded_pool``)
        sketch = turn.layer_bytes * 6 * pool if tiers.sketched else 0
        if tiers.sketched and tiers.standin:
            sketch += turn.layer_bytes * 4 * min(turn.fed, pages * tiers.page_tokens)
        return (kv + turn.token_bytes * min(turn.fed, pages * tiers.page_tokens) + sketch
                + turn.layer_bytes * 2 * (math.ceil(turn.fed / tiers.page_tokens) + turn.new))

    @staticmethod
    def decode_tokens(turn: TurnSize) -> int:
        return turn.kept_after

    @staticmethod
    def cold_tokens_written(turn: TurnSize) -> int:
        """A layer's one selection a turn keeps the prompt budget out of the device's tokens and the cold
        ones it promotes; the device's others are demoted, and a token that was cold before goes back to
        its page: at most the device's tokens past the budget, plus as many as it could promote."""
        device, budget = turn.kept + turn.new, turn.split.prompt_budget
        return 0 if device <= budget else device - budget + min(budget, max(0, turn.fed - turn.kept))

    def cold_tokens(self) -> int:
        return self.cold[0].alive_count()

    def cold_pages(self) -> int:
        return max(cold.live_page_count() for cold in self.cold)

    def cold_residency(self, layer: int) -> ColdResidency:
        return self.cold[layer].residency()

    def cold_bytes(self) -> dict[str, int]:
        host, sid = self.tiers.host, self.tiers.session_id
        redis = host.redis.session_bytes(sid) if host.redis is not None else 0
        return {"host": host.session_bytes(sid), "redis": redis}

    def release(self) -> None:
        self._whole = [None] * len(self._whole)
        self._drop_prefetched()
        for pending in self._pending:  # what a step that failed left on the page reader ends first
            if pending is not None:
                pending.end()
        self._pending = [None] * len(self._pending)
        for cold in self.cold:
            cold.free()

    # --- persistence -------------------------------------------------------------------------
    def persist(self) -> dict | None:
        """Write everything Redis lacks (new cold pages, page tables, the primary set); None if Redis is
        unavailable."""
        host, sid, cache = self.tiers.host, self.tiers.session_id, self.cache
        if host.redis is None:
            return None
        self.settle()
        for i, (cold, store) in enumerate(zip(self.cold, cache.layers)):
            written = host.persist_many(sid, cold.page_ids())
            if written is None:
                return None
            cache.traffic.redis_bytes_written += written
            blobs = {
                f"index-l{i}": cold.index_tensors(),
                f"primary-l{i}": {"keys": store.keys, "values": store.values, "positions": store.positions},
            }
            if not host.redis.put_pages(sid, blobs):
                return None
            cache.traffic.redis_bytes_written += sum(batch_nbytes(b) for b in blobs.values())
        return {"cold": [cold.snapshot() for cold in self.cold]}

    def restore(self, state: dict) -> bool:
        """Rebuild the primary set and the cold bookkeeping from ``persist``'s record and Redis; False if
        anything is missing."""
        redis, sid, spec = self.tiers.host.redis, self.tiers.session_id, self.cache.spec
        if redis is None or len(state.get("cold", [])) != len(self.cache.layers):
            return False
        dev = spec.device
        for i, store in enumerate(self.cache.layers):
            primary, index = redis.get_pages(sid, [f"primary-l{i}", f"index-l{i}"])
            if primary is None or index is None:
                return False
            store.replace(primary["keys"].to(dev, spec.dtype), primary["values"].to(dev, spec.dtype),
                          primary["positions"].to(dev))
            self.cold[i].restore(state["cold"][i], index)
        # A record outliving one of its pages (a replica killed mid-turn, a key evicted) is not trusted.
        return redis.has_pages(sid, [pid for cold in self.cold for pid in cold.page_ids()])
