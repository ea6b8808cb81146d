"""Stage 1's choice of a layer's new primary set over the two parts of its split attention (the device
and the cold pages read back), as a ``Pending`` re-selection that holds only the tokens it promotes.

Called by ``ReselectTiered`` (``policy``) once a layer has attended: inline, or as a job on the page
reader (the tensors it reads are the attention's, which nothing changes meanwhile).
"""
from __future__ import annotations

import torch

from rocketkv_mt.cache.prefill.tiered.pending import Pending
from rocketkv_mt.config import BudgetSplit
from rocketkv_mt.dispatch import choose_over_parts
from rocketkv_mt.split_attention import Part, window_probs
from rocketkv_mt.take_rows import take_rows


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


def choose(parts: list[Part], lse: torch.Tensor, device_pos: torch.Tensor, device_slots: int, cand: tuple,
           total: int, w: int, split: BudgetSplit, kernels: str) -> Pending:
    """Stage 1's choice over the device slots and the read-back ones, from the window rows' mass in
    the merged softmax; of the read-back tokens only those it promotes are kept."""
    # The stand-in's slots weigh in the softmax, so in Stage 1's scores, but hold no slot to choose.
    probs = torch.cat([window_probs(part, lse) for part in parts], dim=1)
    probs = probs[:, : parts[0].window_probs.shape[-1] + cand[0].shape[1]]
    slots, positions, scores = choose_over_parts(probs, device_pos, cand[2], cand[3], total, w,
                                                 split.prompt_budget, split.kernel_size, backend=kernels)
    if len(parts) > 1:
        slots, cand = promoted_only(slots, device_slots, cand)
    return Pending(slots, positions, scores, cand)
