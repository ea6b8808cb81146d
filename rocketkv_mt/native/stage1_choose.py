"""The native Stage-1 choice (``stage1_choose.c``): ``rocketkv_mt.reselect.choose_over_parts`` in one call."""
from __future__ import annotations

import torch

from rocketkv_mt.native import library


def supports(probs: torch.Tensor) -> bool:
    """True when the kernel can take these scores: float32 on the CPU, none NaN, a library built here."""
    return (probs.device.type == "cpu" and probs.dtype == torch.float32 and library() is not None
            and not bool(torch.isnan(probs).any()))


def choose(probs: torch.Tensor, key_pos: torch.Tensor, alive: torch.Tensor | None, history_len: int, w: int,
           prompt_budget: int, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, positions, scores), each (Hkv, kept), from the slots' window probabilities probs (Hkv, S)
    at positions key_pos (Hkv, S), ``alive`` (Hkv, S) or None: what ``scores_by_position`` then
    ``choose`` return. Pass ``supports(probs)`` first."""
    hkv, s = probs.shape
    # The kernel trusts these: a mismatch would read or write outside the tensors, not raise.
    if key_pos.shape != (hkv, s) or (alive is not None and alive.shape != (hkv, s)):
        raise ValueError(f"positions {tuple(key_pos.shape)} or alive flags do not match the scores {tuple(probs.shape)}")
    if not 0 <= w <= history_len or prompt_budget < w or kernel_size < 1:
        raise ValueError(f"window {w}, budget {prompt_budget} or kernel {kernel_size} do not fit a history of {history_len}")
    live = alive.to(torch.uint8).contiguous() if alive is not None else None
    probs, key_pos = probs.contiguous(), key_pos.to(torch.int64).contiguous()
    width = max(prompt_budget, w)
    slots = torch.empty(hkv, width, dtype=torch.int64)
    positions = torch.empty(hkv, width, dtype=torch.int64)
    scores = torch.empty(hkv, width, dtype=torch.float32)
    keep = torch.zeros(1, dtype=torch.int64)
    rc = library().rkv_choose(probs.data_ptr(), key_pos.data_ptr(), None if live is None else live.data_ptr(), hkv, s,
                              history_len, w, prompt_budget, kernel_size, slots.data_ptr(), positions.data_ptr(),
                              scores.data_ptr(), keep.data_ptr())
    if rc == -2:
        raise ValueError("an alive slot's position lies outside the history")
    if rc != 0:
        raise MemoryError("native Stage-1 choice could not allocate its scratch memory")
    n = hkv * (int(keep) + w)  # written with row stride keep + w
    return tuple(t.view(-1)[:n].view(hkv, -1) for t in (slots, positions, scores))
