"""Applying a layer's chosen re-selection: the selection becomes the primary set, the cold tokens it
took are promoted, the device tokens it left demoted, and the decode set is rebuilt. Whole or not at
all: a failure leaves the layer as it was, or marks the cache broken where it cannot.

Called by ``ReselectTiered`` (``policy``) only, on the model thread or, on a CPU, as a job on the page
reader (a layer read whole, while the model thread goes on with the next layer; a layer of a turn fed
layer by layer, while other sessions' steps run): the next layer waits for it.
"""
from __future__ import annotations

import torch

from rocketkv_mt.cache.policy import CacheState
from rocketkv_mt.take_rows import take_rows
from tiers.cold.layer import ColdLayer


def reorganise(cache: CacheState, cold: ColdLayer, layer: int, slots: torch.Tensor, positions: torch.Tensor,
               scores: torch.Tensor, cand: tuple | None) -> None:
    """Make the selection (slots (Hkv, kept) into [device slots, read-back slots ``cand``]) the primary
    set of ``layer``, whose cold tokens ``cold`` keeps: promote the cold tokens it took, demote the
    device tokens it left, rebuild the decode set.

    Everything that may fail for want of room or a tier (the new primary set, the demoted tokens' pages
    written to the host tier, which may spill to Redis) happens before anything changes, so such a
    failure leaves the layer as it was; then the page table, the store and the decode set change, by
    steps that fail only on a bug or a device out of memory. Should one fail all the same, the cache
    is half-updated and is marked broken, never to be used again."""
    store = cache.layers[layer]
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
