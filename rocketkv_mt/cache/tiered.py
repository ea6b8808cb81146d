"""``tiered``: the device holds only the primary set; every other token of the history is cold, in the
host tier or Redis. Each turn, layer by layer, Stage 1 scores the history with the new window:
selected cold tokens are promoted (re-admitted), unselected primary tokens are demoted (DESIGN §3).

Which cold tokens a turn scores is the ``reselect`` policy: ``exhaustive`` reads every cold page;
``digest`` ranks the cold pages by their key bounds (``rocketkv_mt.cold_select``) and reads only the
best ones, so a turn's traffic follows the prompt budget, not the history.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.rocketkv import RocketKVCache
from rocketkv_mt.cold_select import candidate_pages, page_bounds, window_lse
from rocketkv_mt.reselect import reselect
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

    def begin_forward(self, n_new: int, *, prefill: bool, max_new: int = 0) -> None:
        super().begin_forward(n_new, prefill=prefill, max_new=max_new)
        if prefill:
            self.readmitted = 0
            self.traffic.reset()

    def prefill_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        store, cold, split = self.layers[layer], self.cold[layer], self.split
        n = q.shape[1]
        if not cold.has_pages() and store.length <= split.prompt_budget:
            out = dense_attention(q, store.keys, store.values, scaling)
            self.build_kt(layer)
            self.anchors[layer] = None
            return out
        dev = self.spec.device
        w = min(split.window_size, n)
        hist = store.length - n  # primary tokens from earlier turns; the turn's own tokens follow them
        total = self.history_len + n
        cand = self._read_candidates(layer, q[:, -w:], total, scaling)
        m = cand[0].shape[1]
        # History slots first (primary, then the pages read), the turn's tokens last: every history slot
        # is in the past of every new query, so attention is causal with an offset, not positional.
        keys = torch.cat([store.keys[:, :hist], cand[0], store.keys[:, hist:]], dim=1)
        values = torch.cat([store.values[:, :hist], cand[1], store.values[:, hist:]], dim=1)
        pos = torch.cat([store.positions[:, :hist], cand[2], store.positions[:, hist:]], dim=1)
        alive = None
        if m:
            ones = torch.ones_like(store.positions, dtype=torch.bool)
            alive = torch.cat([ones[:, :hist], cand[3], ones[:, hist:]], dim=1)
        if self.tiers.prefill_attention == "dense":
            out = dense_attention(q, keys, values, scaling, visible=alive)
        slots, positions, scores = reselect(
            q[:, -w:], keys, pos, alive, total, split.prompt_budget, split.kernel_size, scaling
        )
        d = keys.shape[-1]
        idx = slots.unsqueeze(-1).expand(-1, -1, d)
        new_k, new_v = torch.gather(keys, 1, idx), torch.gather(values, 1, idx)
        from_cold = (slots >= hist) & (slots < hist + m)
        if m:
            cold_slot = torch.gather(cand[4], 1, (slots - hist).clamp(0, m - 1))
            cold.promote(torch.where(from_cold, cold_slot, -1))
            self.readmitted += int(from_cold.sum())
        # Store slots (primary, then the turn's tokens) that were not kept become cold.
        store_slot = torch.where(slots < hist, slots, slots - m)
        kept = torch.zeros(slots.shape[0], store.length + 1, dtype=torch.bool, device=dev)
        kept.scatter_(1, torch.where(from_cold, store.length, store_slot), True)
        self.traffic.bytes_demoted += cold.demote(store.keys, store.values, store.positions, ~kept[:, : store.length])
        store.replace(new_k, new_v, positions)
        self.on_selected(layer, scores)
        if self.tiers.prefill_attention == "selected":
            out = dense_attention(q, store.keys, store.values, scaling)
        self.build_kt(layer)
        return out

    def _read_candidates(self, layer: int, q_win: torch.Tensor, total: int, scaling: float):
        """The cold pages this turn scores, read from the tiers: keys, values (Hkv, M, d), positions,
        alive, flat cold slots (Hkv, M). ``exhaustive``: all pages with cold tokens; ``digest``: the
        pages whose bounds rank highest, a budgeted number per KV head."""
        cold, dev = self.cold[layer], self.spec.device
        if not cold.has_pages():
            pages = [torch.zeros(0, dtype=torch.long)] * self.spec.num_kv_heads
        elif self.tiers.reselect == "exhaustive":
            pages = cold.live_pages()
        else:
            store = self.layers[layer]
            kmin, kmax, live, nbytes = cold.digests(dev)
            self.traffic.digest_bytes_read += nbytes
            lse = window_lse(q_win, store.keys, store.positions, total, scaling)
            per_head = math.ceil(self.tiers.candidates * self.split.prompt_budget / self.tiers.page_tokens)
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

    def release(self) -> None:
        for cold in self.cold:
            cold.free()

    # --- persistence -------------------------------------------------------------------------
    def persist(self) -> dict | None:
        """Write everything Redis lacks (new cold pages, page tables, the primary set); None if Redis is
        unavailable."""
        host, sid = self.tiers.host, self.tiers.session_id
        if host.redis is None:
            return None
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
