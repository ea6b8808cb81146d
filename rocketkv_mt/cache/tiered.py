"""``tiered``: the device holds only the primary set; every other token of the history is cold, in the
host tier or Redis. Each turn, layer by layer, Stage 1 scores the history with the new window:
selected cold tokens are promoted (re-admitted), unselected primary tokens are demoted (DESIGN §3).

Which cold tokens a turn scores is the ``reselect`` policy: ``exhaustive`` reads every cold page;
``digest`` ranks the cold pages by their key bounds (``rocketkv_mt.cold_select``) and reads only the
best ones, so a turn's traffic follows the prompt budget, not the history.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from rocketkv_mt.attention_ops import dense_attention, positional_attention
from rocketkv_mt.cache.rocketkv import RocketKVCache
from rocketkv_mt.cold_select import candidate_pages, page_bounds, pages_per_head
from rocketkv_mt.reselect import choose, reselect, scores_by_position
from rocketkv_mt.split_attention import attend_part, merge, window_probs
from tiers.base import batch_nbytes
from tiers.codec import PageCodec, RawCodec
from tiers.cold_layer import ColdLayer
from tiers.host import HostTier


@dataclass
class TierContext:
    """Where a tiered session keeps its cold tokens, and how a turn reads them back.

    page_tokens: cold tokens per page of one KV head (the unit that moves and has a digest).
    prefill_attention: the turn's tokens attend over everything the turn read (``dense``) or over
    the new primary set (``selected``). candidates: cold tokens' worth of pages a ``digest`` turn
    reads per KV head, as a fraction of the prompt budget."""

    host: HostTier
    session_id: str
    page_tokens: int = 32
    prefill_attention: Literal["dense", "selected"] = "dense"
    reselect: Literal["digest", "exhaustive"] = "digest"
    candidates: float = 0.5
    codec: PageCodec = field(default_factory=RawCodec)


@dataclass
class Pending:
    """A layer's re-selection, computed up to the scores: probs (Hkv, T + M) of the device slots and
    the read-back slots ``cand`` (keys, values, positions, alive, cold slots), their positions and
    alive flags, the history length and the window."""

    probs: torch.Tensor
    key_pos: torch.Tensor
    alive: torch.Tensor | None
    cand: tuple
    total: int
    w: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cand[:2])


class TieredCache(RocketKVCache):
    mode = "tiered"

    def __init__(self, spec, rocket=None, tiers: TierContext | None = None):
        super().__init__(spec, rocket)
        if tiers is None:
            raise ValueError("the tiered mode needs a TierContext (host tier and session id)")
        self.tiers = tiers
        self.cold = [
            ColdLayer(tiers.session_id, i, tiers.host, tiers.page_tokens, tiers.codec, spec.num_kv_heads,
                      spec.head_dim, spec.dtype)
            for i in range(spec.num_layers)
        ]
        self._pending: list[Pending | None] = [None] * spec.num_layers

    def begin_forward(self, n_new: int, *, prefill: bool, max_new: int = 0, rest: int = 0) -> None:
        if prefill:
            self.settle()
        super().begin_forward(n_new, prefill=prefill, max_new=max_new, rest=rest)
        if prefill:
            self.readmitted = 0
            self.traffic.reset()

    def last_chunk_min(self) -> int | None:
        # The cold pages a turn reads, and with ``selected`` what every new token attends to, follow
        # from the turn's last window: earlier chunks could not attend as the whole prefill does.
        if self.tiers.prefill_attention == "selected" or any(cold.has_pages() for cold in self.cold):
            return None
        return super().last_chunk_min()

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        if self._pending[layer] is not None:  # the first decode step: the turn's selection takes effect
            self._settle(layer)
        return super()._attend(layer, q, k, v, scaling)

    def prefill_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        store, cold, split = self.layers[layer], self.cold[layer], self.split
        n = q.shape[1]
        if not cold.has_pages() and store.length <= split.prompt_budget:
            out = dense_attention(q, store.keys, store.values, scaling)
            self.build_kt(layer)
            self.anchors[layer] = None
            return out
        w = min(split.window_size, n)
        total = self.history_len + n
        if not cold.has_pages():
            # Nothing cold yet (a first turn): the device holds the history in order, as SnapKV sees it.
            out = dense_attention(q, store.keys, store.values, scaling)
            slots, positions, scores = reselect(
                q[:, -w:], store.keys, store.positions, None, total, split.prompt_budget, split.kernel_size, scaling
            )
            self._reorganise(layer, slots, positions, scores, None)
            return self._selected_attention(layer, q, scaling) if self.tiers.prefill_attention == "selected" else out
        # The device part first (primary set and the turn, the turn causal); its normaliser ranks the
        # cold pages; the pages read back are the second part; one exact softmax over both.
        device = attend_part(q, store.keys, store.values, scaling, w, own_tail=n)
        cand = self._read_candidates(layer, q[:, -w:], device.lse[:, -w:], scaling)
        parts = [device]
        if cand[0].shape[1]:
            parts.append(attend_part(q, cand[0], cand[1], scaling, w, visible=cand[3]))
        out, lse = merge(parts, q.dtype)
        probs = torch.cat([window_probs(part, lse) for part in parts], dim=1)
        key_pos, alive = store.positions, None
        if len(parts) > 1:
            key_pos = torch.cat([store.positions, cand[2]], dim=1)
            alive = torch.cat([torch.ones_like(store.positions, dtype=torch.bool), cand[3]], dim=1)
        self._pending[layer] = Pending(probs, key_pos, alive, cand, total, w)
        # The first token needs only this attention; the re-selection (choose, promote, demote, KT)
        # waits for the layer's first decode step. Reading every page back (exhaustive) would hold a
        # whole cold history per layer until then, so that rule settles at once.
        if self.tiers.prefill_attention == "selected" or self.tiers.reselect == "exhaustive":
            self._settle(layer)
        return self._selected_attention(layer, q, scaling) if self.tiers.prefill_attention == "selected" else out

    def _settle(self, layer: int) -> None:
        """Run a layer's pending re-selection on the keys its turn attended to."""
        p, self._pending[layer] = self._pending[layer], None
        split = self.split
        raw = scores_by_position(p.probs, p.key_pos, p.alive, p.total, p.w)
        slots, positions, scores = choose(raw, p.key_pos, p.alive, p.total, p.w, split.prompt_budget, split.kernel_size)
        self._reorganise(layer, slots, positions, scores, p.cand)

    def settle(self) -> None:
        """Every layer's pending re-selection, now (before a new turn, at a turn's end, before persisting)."""
        for layer, pending in enumerate(self._pending):
            if pending is not None:
                self._settle(layer)

    def _selected_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """The turn's queries over the new primary set only (which keeps just some of the turn's tokens)."""
        store = self.layers[layer]
        return positional_attention(q, self.positions(q.shape[1]), store.keys, store.values, store.positions, None, scaling)

    def _reorganise(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor, cand) -> None:
        """Make the selection (slots (Hkv, kept) into [device slots, read-back slots]) the primary set:
        promote the cold tokens it took, demote the device tokens it left, rebuild the KT cache."""
        store, cold = self.layers[layer], self.cold[layer]
        t, d = store.length, store.keys.shape[-1]
        keys, values = store.keys, store.values
        from_cold = slots >= t
        if cand is not None and cand[0].shape[1]:
            keys, values = torch.cat([keys, cand[0]], dim=1), torch.cat([values, cand[1]], dim=1)
            cold_slot = torch.gather(cand[4], 1, (slots - t).clamp(min=0))
            cold.promote(torch.where(from_cold, cold_slot, -1))
            self.readmitted += int(from_cold.sum())
        idx = slots.unsqueeze(-1).expand(-1, -1, d)
        new_k, new_v = torch.gather(keys, 1, idx), torch.gather(values, 1, idx)
        kept = torch.zeros(slots.shape[0], t + 1, dtype=torch.bool, device=slots.device)
        kept.scatter_(1, torch.where(from_cold, t, slots), True)
        self.traffic.bytes_demoted += cold.demote(store.keys, store.values, store.positions, ~kept[:, :t])
        store.replace(new_k, new_v, positions)
        self.on_selected(layer, scores)
        self.build_kt(layer)

    def _read_candidates(self, layer: int, q_win: torch.Tensor, lse_win: torch.Tensor, scaling: float):
        """The cold pages this turn scores, read from the tiers: keys, values (Hkv, M, d), positions,
        alive, flat cold slots (Hkv, M). ``exhaustive``: all pages with cold tokens; ``digest``: the
        pages whose bounds rank highest, a budgeted number per KV head. ``lse_win`` (Hq, w): the
        window rows' normaliser over the device keys."""
        cold, dev = self.cold[layer], self.spec.device
        if self.tiers.reselect == "exhaustive":
            pages = cold.live_pages()
        else:
            kmin, kmax, live, nbytes = cold.digests(dev)
            self.traffic.digest_bytes_read += nbytes
            lse = lse_win.reshape(kmin.shape[0], -1)
            per_head = pages_per_head(self.tiers.candidates, self.split.prompt_budget, self.tiers.page_tokens)
            pages = candidate_pages(page_bounds(q_win, kmin, kmax, lse, scaling), live, per_head)
        return cold.fetch(pages, dev, self.traffic)

    def after_prefill(self, layer: int, q: torch.Tensor, scaling: float) -> None:  # prefill_attention does it all
        raise NotImplementedError

    # --- accounting --------------------------------------------------------------------------
    def cold_tokens(self) -> int:
        return self.cold[0].alive_count()

    def tier_bytes(self) -> dict[str, int]:
        host = self.tiers.host
        redis = host.redis.session_bytes(self.tiers.session_id) if host.redis is not None else 0
        return {"device": self.device_bytes(), "host": host.session_bytes(self.tiers.session_id), "redis": redis}

    def end_turn(self) -> None:
        self.settle()

    def device_bytes(self) -> int:
        return super().device_bytes() + sum(p.nbytes() for p in self._pending if p is not None)

    def release(self) -> None:
        self._pending = [None] * len(self._pending)
        for cold in self.cold:
            cold.free()

    # --- persistence -------------------------------------------------------------------------
    def persist(self) -> dict | None:
        """Write everything Redis lacks (new cold pages, page tables, the primary set); None if Redis is
        unavailable."""
        host, sid = self.tiers.host, self.tiers.session_id
        if host.redis is None:
            return None
        self.settle()
        for i, (cold, store) in enumerate(zip(self.cold, self.layers)):
            written = host.persist_many(sid, cold.page_ids())
            if written is None:
                return None
            self.traffic.redis_bytes_written += written
            blobs = {
                f"index-l{i}": cold.index_tensors(),
                f"primary-l{i}": {"keys": store.keys, "values": store.values, "positions": store.positions},
            }
            if not host.redis.put_pages(sid, blobs):
                return None
            self.traffic.redis_bytes_written += sum(batch_nbytes(b) for b in blobs.values())
        return {"history_len": self.history_len, "cold": [cold.snapshot() for cold in self.cold]}

    def restore(self, state: dict) -> bool:
        """Rebuild from ``persist``'s record and Redis; False if anything is missing."""
        redis, sid = self.tiers.host.redis, self.tiers.session_id
        if redis is None or len(state.get("cold", [])) != len(self.layers):
            return False
        dev = self.spec.device
        for i, store in enumerate(self.layers):
            primary, index = redis.get_pages(sid, [f"primary-l{i}", f"index-l{i}"])
            if primary is None or index is None:
                return False
            store.replace(primary["keys"].to(dev, self.spec.dtype), primary["values"].to(dev, self.spec.dtype),
                          primary["positions"].to(dev))
            self.cold[i].restore(state["cold"][i], index)
        # A record outliving one of its pages (a replica killed mid-turn, a key evicted) is not trusted.
        if not redis.has_pages(sid, [pid for cold in self.cold for pid in cold.page_ids()]):
            return False
        self.history_len = int(state["history_len"])
        return True
