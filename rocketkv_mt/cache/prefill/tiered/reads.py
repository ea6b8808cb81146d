"""Which cold pages a tiered turn reads back, and reading them ahead: per layer, whether it is read
whole or ranked (by key bounds, then by key sketches, with a stand-in for pages scored but not read),
and the next layer's sketch decode or whole read started on the page reader beside this layer's
attention. Also what those reads hold on the device until they are handed over.

``ColdReads`` is owned by ``ReselectTiered`` (``policy``), which calls it from the model thread; the
jobs it starts run on the page reader. The module's functions are shared with the memory bound
(``bounds``).
"""
from __future__ import annotations

import math
from functools import partial

import torch

from rocketkv_mt.cache.policy import CacheState
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.cold_select import (
    candidate_pages,
    page_bounds,
    page_picks,
    pages_per_head,
    pool_logits,
    sketch_dtype,
)
from rocketkv_mt.split_attention import Part
from rocketkv_mt.standin import StandIn, standin_pages
from rocketkv_mt.take_rows import take_rows
from tiers.cold.layer import ColdLayer, Sketched


def read_bytes(cand: tuple) -> int:
    """Bytes of the keys and values of read-back tokens (``cand``'s first two tensors)."""
    return sum(t.numel() * t.element_size() for t in cand[:2])


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


class ColdReads:
    """A tiered session's reads of its cold pages (``cold``, one ``ColdLayer`` per layer): the pages a
    layer's turn reads (``candidates``), and per layer what was started ahead of its attention."""

    def __init__(self, cache: CacheState, tiers: TierContext, cold: list[ColdLayer]) -> None:
        self.cache, self.tiers, self.cold = cache, tiers, cold
        spec = cache.spec
        # A layer's whole pool of sketched pages and the worker's decode of it, started while the layer
        # before it computes (``_prefetch_sketch``): its estimated keys do not depend on the queries.
        self._sketches: list[tuple[torch.Tensor, object] | None] = [None] * spec.num_layers
        self._sketch_dtype = sketch_dtype(spec.device, spec.dtype)
        # A layer read whole (``whole``): its pages, read on the page reader while the layer before
        # it computes (``_prefetch_read``); they do not depend on the queries either.
        self._reads: list[object | None] = [None] * spec.num_layers
        # Per layer, whether this turn reads it whole (``whole``), known until its cold set changes:
        # asked when the layer before prefetches its sketch and again when it attends.
        self._whole: list[bool | None] = [None] * spec.num_layers

    def forget(self) -> None:
        """A turn begins, or the session goes: what was started ahead ends (``drop``), and whether each
        layer is read whole is asked again (the turn's budget may differ)."""
        self._whole = [None] * len(self._whole)
        self.drop()

    def cold_set_changed(self, layer: int) -> None:
        """The layer's cold set changes (a re-selection): whether it is read whole is asked again."""
        self._whole[layer] = None

    def prefetch(self, layer: int) -> None:
        """Start what ``layer`` will read on the page reader, beside the attention of the layer before
        it: its whole pool's sketch decode, or its whole read."""
        self._prefetch_sketch(layer)
        self._prefetch_read(layer)

    def whole(self, layer: int) -> bool:
        """Whether this turn reads the layer whole (``reads_whole``), known until its cold set changes."""
        if self._whole[layer] is None:
            policy, budget = self.tiers.policy, self.cache.split.prompt_budget
            # ``exhaustive`` reads every layer whole: no page count needed.
            self._whole[layer] = policy.reselect == "exhaustive" or reads_whole(
                policy, self.cold[layer].live_page_count(at_most=whole_limit(policy, budget)), budget)
        return self._whole[layer]

    def pool_logits_ahead(self, layer: int, q_win: torch.Tensor, scaling: float):
        """Start the window rows' logits over the layer's prefetched sketch on the page reader
        (``cold_select.pool_logits``); None when no sketch was prefetched."""
        started, transfers = self._sketches[layer], self.tiers.transfers
        if started is None or transfers is None:
            return None
        decoding = started[1]
        return transfers.start(lambda: pool_logits(q_win, transfers.wait(decoding).keys, scaling), reads_device=True)

    def candidates(self, layer: int, q_win: torch.Tensor, window: Part, scaling: float, total: int,
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
                or self.whole(layer)):
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
                or not self.whole(layer)):
            return
        self._reads[layer] = transfers.start(partial(self._read_whole, layer))

    def _read_whole(self, layer: int) -> tuple:
        """Every page of the layer that holds a cold token, read back (``ColdLayer.fetch``)."""
        cold = self.cold[layer]
        return cold.fetch(cold.live_pages(), self.cache.spec.device, self.cache.traffic)

    def drop(self) -> None:
        """Let every decode and read in flight finish, and those not begun never run (a turn that stopped
        between layers), then forget them: the next turn's pools and cold sets differ."""
        for started in self._sketches:
            if started is not None:
                self.tiers.transfers.forget(started[1])
        for started in self._reads:
            if started is not None:
                self.tiers.transfers.forget(started)
        self._sketches = [None] * len(self._sketches)
        self._reads = [None] * len(self._reads)

    def nbytes(self) -> int:
        """A next layer's read once done (held until its layer attends)."""
        return sum(read_bytes(r.result()) for r in self._reads if r is not None and r.done() and not r.cancelled()
                   and r.exception() is None)
