"""A later ``tiered`` turn's prefill fed layer by layer (``app.engine.layer_prefill``), exact, with one
layer of the turn on the device at a time.

A whole prefill of a later turn attends every new row over the device (the primary set and the turn,
the turn causal) and over the cold pages its window rows pick; Stage 1 then chooses the layer's new
primary set from the window rows' mass. Fed layer by layer, each layer does the same in three steps
(``ComposedCache.begin_layered``): the whole turn's keys and values join the layer's store first
(``layered_keys``); then the window rows, computed from the layer's input, rank and read the cold pages
and make the choice (``window``); then the turn's rows attend in groups over the device and the pages
read (``rows``), and after the last group the choice is applied (``end``): turn tokens Stage 1 does not
keep are demoted to the cold tiers as pages, chosen cold ones promoted, before the next layer runs.
So a layer holds its turn tokens and its pages read back only while it is the one running (and, from
its window on, the next layer's read ahead, as a whole prefill holds it).

Shapes: q_win (Hq, w, d) the layer's window rows; q (Hq, r, d) a group of r rows starting at turn row
``first_row``; keys and values (Hkv, T, d).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from rocketkv_mt.cache.prefill.tiered.choice import choose
from rocketkv_mt.cache.prefill.tiered.pending import Pending
from rocketkv_mt.cache.prefill.tiered.reads import read_bytes
from rocketkv_mt.split_attention import attend_part, merge
from rocketkv_mt.standin import beside


@dataclass
class _Running:
    """The running layer's part besides the device (the pages read back and the stand-in's slots; None
    when nothing is cold) and its choice (None: Stage 1 over the device alone, at ``end``)."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    visible: torch.Tensor | None
    choice: Pending | None
    q_win: torch.Tensor
    scaling: float


class TieredLayeredTurn:
    """The three steps of each layer of one later turn, on a ``ReselectTiered`` policy."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self._running: dict[int, _Running] = {}

    def window(self, layer: int, q_win: torch.Tensor, scaling: float) -> None:
        """The layer's store holds the whole turn: its window rows pick and read cold pages and choose."""
        policy = self.policy
        cache, cold = policy.cache, policy.cold[layer]
        store, split, n = cache.layers[layer], cache.split, cache.step.n_new
        w, total, kernels = q_win.shape[1], cache.history_len + n, cache.spec.kernels
        # The next layer's sketch decode or whole read runs on the page reader beside this layer's
        # reads and row groups, as it runs beside a whole prefill's attention; the turn's bound counts it.
        policy.reads.prefetch(layer + 1)
        if not cold.has_pages():  # nothing cold: Stage 1 over the store after the rows, as a first turn's
            self._running[layer] = _Running(None, None, None, None, q_win, scaling)
            return
        window = attend_part(q_win, store.keys, store.values, scaling, w, own_tail=n, first_row=n - w, backend=kernels)
        cand, standin = policy.reads.candidates(layer, q_win, window, scaling, total, policy.reads.whole(layer))
        keys, values, visible = beside(cand, standin)
        parts = [window]
        if keys.shape[1]:
            parts.append(attend_part(q_win, keys, values, scaling, w, visible=visible, backend=kernels))
        _, lse = merge(parts, q_win.dtype)
        choice = choose(parts, lse, store.positions, store.length, cand, total, w, split, kernels)
        self._running[layer] = _Running(keys, values, visible, choice, q_win, scaling)

    def rows(self, layer: int, q: torch.Tensor, first_row: int) -> torch.Tensor:
        """A group of the turn's rows over the device (the turn causal) and the pages read back."""
        cache, run = self.policy.cache, self._running[layer]
        store, n, kernels = cache.layers[layer], cache.step.n_new, cache.spec.kernels
        parts = [attend_part(q, store.keys, store.values, run.scaling, 0, own_tail=n, first_row=first_row,
                             backend=kernels)]
        if run.keys is not None and run.keys.shape[1]:
            parts.append(attend_part(q, run.keys, run.values, run.scaling, 0, visible=run.visible, backend=kernels))
        out, _ = merge(parts, q.dtype)
        return out

    def begin(self, layer: int) -> None:
        """Before the layer takes the turn's keys: the layer before it has applied its choice (it may
        still be applying it on the page reader), so one layer at a time holds the turn."""
        self.policy.previous_chosen(layer)

    def end(self, layer: int) -> None:
        """Every row has attended: the choice becomes the layer's primary set (the rest goes cold). On
        a CPU the application (demoting the turn's tokens as pages) runs on the page reader, beside
        other sessions' decode steps, until the next layer begins (after the last layer: until the
        session's first decode step, which the batcher holds back meanwhile): it took 20 to 120 ms of
        one core for a 5.5k-token turn, longer than a slice, and was the longest pause of the streams."""
        run = self._running.pop(layer)
        policy = self.policy
        apply = (partial(policy.select, layer, run.q_win, run.scaling) if run.choice is None
                 else partial(policy.apply, layer, run.choice))
        if not policy.settles_beside(layer, last_too=True):
            apply()
            return
        held = run.choice.cand if run.choice is not None else ()
        policy.settle_beside(layer, apply, held)

    def drop(self) -> None:
        """A prefill taken back, or the cache released: what the running layer held goes."""
        self._running.clear()

    def nbytes(self) -> int:
        """The running layer's pages read back and its choice's promoted tokens."""
        return sum(read_bytes((run.keys, run.values)) + run.choice.nbytes()
                   for run in self._running.values() if run.choice is not None)
