"""``tiered``: the device holds only the primary set; every other token of the history is cold, in the
host tier or Redis. Each turn, layer by layer, Stage 1 scores the whole history with the new window:
selected cold tokens are promoted (re-admitted), unselected primary tokens are demoted (DESIGN §3)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rocketkv_mt.attention_ops import dense_attention, positional_attention
from rocketkv_mt.cache.rocketkv import RocketKVCache
from rocketkv_mt.reselect import reselect
from tiers.cold_layer import ColdLayer
from tiers.host import HostTier


@dataclass
class TierContext:
    """Where a tiered session keeps its cold tokens."""

    host: HostTier
    session_id: str
    chunk_tokens: int = 128
    prefill_attention: Literal["dense", "selected"] = "dense"


class TieredCache(RocketKVCache):
    mode = "tiered"

    def __init__(self, spec, rocket=None, tiers: TierContext | None = None):
        super().__init__(spec, rocket)
        if tiers is None:
            raise ValueError("the tiered mode needs a TierContext (host tier and session id)")
        self.tiers = tiers
        self.cold = [ColdLayer(tiers.session_id, i, tiers.host, tiers.chunk_tokens) for i in range(spec.num_layers)]
        self.readmitted = 0  # cold tokens promoted this turn, summed over layers and KV heads

    def begin_forward(self, n_new: int, *, prefill: bool, max_new: int = 0) -> None:
        super().begin_forward(n_new, prefill=prefill, max_new=max_new)
        if prefill:
            self.readmitted = 0

    def prefill_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        store, cold, split = self.layers[layer], self.cold[layer], self.split
        n = q.shape[1]
        q_pos = self.positions(n)
        if not cold.refs and store.length <= split.prompt_budget:
            out = dense_attention(q, store.keys, store.values, scaling)
            self.build_kt(layer)
            self.anchors[layer] = None
            return out
        dev = self.spec.device
        n_primary, n_cold = store.length, len(cold)
        keys, pos, alive = store.keys, store.positions, None
        if n_cold:
            keys = torch.cat([keys, cold.keys(dev)], dim=1)
            pos = torch.cat([pos, cold.positions(dev)], dim=1)
            alive = torch.cat([torch.ones_like(store.positions, dtype=torch.bool), cold.alive(dev)], dim=1)
        values = None
        if self.tiers.prefill_attention == "dense":
            values = torch.cat([store.values, cold.values(dev)], dim=1) if n_cold else store.values
            out = positional_attention(q, q_pos, keys, values, pos, alive, scaling)
        w = min(split.window_size, n)
        slots, positions, scores = reselect(
            q[:, -w:], keys, pos, alive, self.history_len + n, split.prompt_budget, split.kernel_size, scaling
        )
        from_primary = slots < n_primary
        d = keys.shape[-1]
        idx = slots.unsqueeze(-1).expand(-1, -1, d)
        new_k = torch.gather(keys, 1, idx)
        if values is not None:
            new_v = torch.gather(values, 1, idx)
        else:
            new_v = torch.gather(store.values, 1, slots.clamp(max=n_primary - 1).unsqueeze(-1).expand(-1, -1, d))
            if n_cold:
                cold_v = cold.values_at((slots - n_primary).clamp(min=0), dev)
                new_v = torch.where(from_primary.unsqueeze(-1), new_v, cold_v)
        hkv = slots.shape[0]
        if n_cold:
            promoted = torch.zeros(hkv, n_cold + 1, dtype=torch.bool, device=dev)
            promoted.scatter_(1, torch.where(from_primary, n_cold, slots - n_primary), True)
            cold.kill(promoted[:, :n_cold])
            self.readmitted += int((~from_primary).sum())
        kept = torch.zeros(hkv, n_primary + 1, dtype=torch.bool, device=dev)
        kept.scatter_(1, torch.where(from_primary, slots, n_primary), True)
        cold.add(store.keys, store.values, store.positions, ~kept[:, :n_primary])
        store.replace(new_k, new_v, positions)
        self.on_selected(layer, scores)
        cold.compact(dev)
        if self.tiers.prefill_attention == "selected":
            out = positional_attention(q, q_pos, store.keys, store.values, store.positions, None, scaling)
        self.build_kt(layer)
        return out

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
        """Write everything Redis lacks (new cold chunks, the primary set); None if Redis is unavailable."""
        host, sid = self.tiers.host, self.tiers.session_id
        if host.redis is None:
            return None
        for cold in self.cold:
            for ref in cold.refs:
                if not host.persist((sid, ref.chunk_id)):
                    return None
        for i, store in enumerate(self.layers):
            tensors = {"keys": store.keys, "values": store.values, "positions": store.positions}
            if not host.redis.put_tensors(sid, f"primary-l{i}", tensors):
                return None
        return {"history_len": self.history_len, "cold": [cold.snapshot() for cold in self.cold]}

    def restore(self, state: dict) -> bool:
        """Rebuild from ``persist``'s record and Redis; False if anything is missing."""
        redis, sid = self.tiers.host.redis, self.tiers.session_id
        if redis is None or len(state.get("cold", [])) != len(self.layers):
            return False
        for i, store in enumerate(self.layers):
            tensors = redis.get_tensors(sid, f"primary-l{i}")
            if tensors is None:
                return False
            dev = self.spec.device
            store.replace(tensors["keys"].to(dev, self.spec.dtype), tensors["values"].to(dev, self.spec.dtype),
                          tensors["positions"].to(dev))
            self.cold[i].restore(state["cold"][i])
        self.history_len = int(state["history_len"])
        return True
