"""The memory map of a session's cache: for every history position, layer and KV head, where that
token's keys and values are, and which of them the last turn moved.

States: ``device`` (in the layer's store), ``host`` / ``redis`` (cold, its page in the host tier, or
spilled to Redis only), ``evicted`` (fed, then dropped for good: ``snapkv`` and ``rocketkv``),
``unfed`` (in the conversation, not fed to the cache yet: the next turn prefills it), ``lost`` (a
cold page no tier holds; the next turn that reads it rebuilds the cache). Flags: ``readmitted``
(cold before the last turn, on the device after it) and ``demoted`` (made cold by the last turn,
its own tokens that it did not keep included).

Built from the cache's bookkeeping only: the layer stores' positions and the prefill policy's cold
residency (``PrefillPolicy.cold_residency``: page tables and the host tier's page set). No key or
value is read or copied; the cost is one byte per (layer, KV head, position) and one host-tier
look-up per cold page.

The wire form (``encode``) is run-lengths per (layer, KV head) row, see docs/observability.md. The
summary alone (``map_summary``, what every ``done`` event carries) is counted from the same
bookkeeping without the per-position map: its cost follows the cold pages, not the history.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rocketkv_mt.cache.store import LayerKV
from tiers.cold.table import IN_HOST, IN_REDIS, NOWHERE, ColdResidency

STATES = ("device", "host", "redis", "evicted", "unfed", "lost")
DEVICE, HOST, REDIS, EVICTED, UNFED, LOST = range(len(STATES))
ENCODING = "rle/1"
# A cold page's tier code (``tiers.cold.table``) -> its state.
_COLD_STATE = torch.zeros(max(IN_HOST, IN_REDIS, NOWHERE) + 1, dtype=torch.uint8)
_COLD_STATE[IN_HOST], _COLD_STATE[IN_REDIS], _COLD_STATE[NOWHERE] = HOST, REDIS, LOST


class ColdSource(Protocol):
    """What the map reads of a prefill policy (``PrefillPolicy.cold_residency``)."""

    def cold_residency(self, layer: int) -> ColdResidency | None: ...


@dataclass(frozen=True)
class MemoryMap:
    """``states`` (L, Hkv, N) uint8 codes of ``STATES``; ``readmitted`` / ``demoted`` (L, Hkv, N) bool;
    ``fed``: positions the cache has been fed (the rest are ``unfed``)."""

    states: torch.Tensor
    readmitted: torch.Tensor
    demoted: torch.Tensor
    fed: int

    def summary(self) -> dict[str, int]:
        """Token slots (one position of one layer and one KV head) per state and flag, with the shape."""
        layers, heads, positions = self.states.shape
        counts = torch.bincount(self.states.flatten().long(), minlength=len(STATES)).tolist()
        return {"layers": layers, "kv_heads": heads, "positions": positions,
                **dict(zip(STATES, counts)),
                "readmitted": int(self.readmitted.sum()), "demoted": int(self.demoted.sum())}

    def encode(self) -> dict:
        """The wire form: per (layer, KV head) row, ``runs`` [state, length, state, length, ...] covering
        positions 0..N-1 in order, and ``readmitted`` / ``demoted`` as [start, length, ...] ranges."""
        layers, heads, _ = self.states.shape
        rows = []
        for layer in range(layers):
            for head in range(heads):
                rows.append({
                    "layer": layer, "head": head,
                    "runs": runs(self.states[layer, head]),
                    "readmitted": ranges(self.readmitted[layer, head]),
                    "demoted": ranges(self.demoted[layer, head]),
                })
        return {"encoding": ENCODING, "states": list(STATES), "fed": self.fed, "rows": rows,
                "summary": self.summary()}


def runs(row: torch.Tensor) -> list[int]:
    """Run-lengths of a 1-D tensor, flat: [value, length, value, length, ...]."""
    if not row.numel():
        return []
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(row[1:] != row[:-1]).flatten() + 1])
    lengths = torch.diff(torch.cat([starts, torch.tensor([row.numel()])]))
    return torch.stack([row[starts].long(), lengths], dim=1).flatten().tolist()


def ranges(mask: torch.Tensor) -> list[int]:
    """The set stretches of a 1-D bool tensor, flat: [start, length, start, length, ...]."""
    if not bool(mask.any()):
        return []
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), mask.to(torch.int8), torch.zeros(1, dtype=torch.int8)]))
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return torch.stack([starts, ends - starts], dim=1).flatten().tolist()


def memory_map(layers: list[LayerKV], prefill: ColdSource, fed: int, positions: int) -> MemoryMap:
    """The map of a cache whose layer stores are ``layers`` and prefill policy ``prefill``, fed ``fed``
    tokens of a conversation of ``positions`` (more than ``fed`` while a reply's closing or the next
    message waits for the next turn's prefill)."""
    heads = layers[0].positions.shape[0] if layers else 0
    n = max(positions, fed)
    states = torch.full((len(layers), heads, n), UNFED, dtype=torch.uint8)
    states[:, :, :fed] = EVICTED
    readmitted = torch.zeros(states.shape, dtype=torch.bool)
    demoted = torch.zeros(states.shape, dtype=torch.bool)
    for layer, store in enumerate(layers):
        cold = prefill.cold_residency(layer)
        if cold is not None:
            for head in range(heads):
                states[layer, head, cold.positions[head]] = _COLD_STATE[cold.tiers[head].long()]
                readmitted[layer, head, cold.promoted[head]] = True
                demoted[layer, head, cold.demoted[head]] = True
        states[layer].scatter_(1, store.positions.cpu(), DEVICE)
    on_device = states == DEVICE
    return MemoryMap(states, readmitted & on_device, demoted & ~on_device & (states != EVICTED), fed)


def map_summary(layers: list[LayerKV], prefill: ColdSource, fed: int, positions: int) -> dict[str, int]:
    """``memory_map(...).summary()``, counted without the map: device slots from the stores' lengths,
    cold ones by their pages' tiers, the last turn's moves from its records (one selection per layer
    a turn: what it promoted is on the device, what it demoted is cold)."""
    heads = layers[0].positions.shape[0] if layers else 0
    n = max(positions, fed)
    counts = dict.fromkeys(STATES, 0)
    readmitted = demoted = 0
    tier_state = {IN_HOST: "host", IN_REDIS: "redis", NOWHERE: "lost"}
    for layer, store in enumerate(layers):
        counts["device"] += store.length * heads
        cold = prefill.cold_residency(layer)
        if cold is None:
            continue
        for head in range(heads):
            for code, state in tier_state.items():
                counts[state] += int((cold.tiers[head] == code).sum())
            readmitted += int(cold.promoted[head].numel())
            demoted += int(cold.demoted[head].numel())
    slots = len(layers) * heads
    counts["unfed"] = (n - fed) * slots
    counts["evicted"] = fed * slots - counts["device"] - counts["host"] - counts["redis"] - counts["lost"]
    return {"layers": len(layers), "kv_heads": heads, "positions": n, **counts,
            "readmitted": readmitted, "demoted": demoted}


def parked_summary(layers: int, heads: int, fed: int, positions: int, in_redis: bool) -> dict[str, int]:
    """``parked_map(...).summary()``, counted without the map."""
    n, slots = max(positions, fed), layers * heads
    stored = fed if in_redis else 0
    return {"layers": layers, "kv_heads": heads, "positions": n, **dict.fromkeys(STATES, 0),
            "redis": stored * slots, "unfed": (n - stored) * slots, "readmitted": 0, "demoted": 0}


def parked_map(layers: int, heads: int, fed: int, positions: int, in_redis: bool) -> MemoryMap:
    """The map of a session whose cache is off the device: its ``fed`` tokens all in Redis (a parked
    ``tiered`` cache, restored at its next turn) or ``unfed`` (re-prefilled at its next turn)."""
    n = max(positions, fed)
    states = torch.full((layers, heads, n), UNFED, dtype=torch.uint8)
    if in_redis:
        states[:, :, :fed] = REDIS
    flags = torch.zeros(states.shape, dtype=torch.bool)
    return MemoryMap(states, flags, flags.clone(), fed if in_redis else 0)
