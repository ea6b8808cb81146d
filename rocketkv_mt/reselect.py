"""Stage 1 over a whole history whose tokens sit in any order (device primary set + cold tiers).

Shapes: Hq query heads, Hkv KV heads, w window queries, T stored slots, H history length, d head dim.
"""
from __future__ import annotations

import torch

from rocketkv_mt.anchors import kept_scores
from rocketkv_mt.stage1 import select_top, smooth


def scattered_window_scores(
    q_win: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    alive: torch.Tensor | None,
    history_len: int,
    scaling: float,
) -> torch.Tensor:
    """Window attention mass per history position: (Hkv, H - w) float32.

    q_win (Hq, w, d): the last w queries, at positions H - w .. H - 1. keys (Hkv, T, d) with their
    positions key_pos (Hkv, T); slots where ``alive`` is False hold no token and are ignored.
    The same quantity as ``stage1.window_scores`` on the keys put back in position order.
    """
    probs = window_slot_probs(q_win, keys, key_pos, alive, history_len, scaling)
    return scores_by_position(probs, key_pos, alive, history_len, q_win.shape[1])


def window_slot_probs(q_win: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, alive: torch.Tensor | None,
                      history_len: int, scaling: float) -> torch.Tensor:
    """Each slot's window attention mass, summed over the window and the group's query heads:
    (Hkv, T) float32 (0 at dead slots). Shapes as ``scattered_window_scores``."""
    hq, w, d = q_win.shape
    hkv, t, _ = keys.shape
    g = hq // hkv
    logits = torch.matmul(q_win.reshape(hkv, g * w, d).float(), keys.float().transpose(1, 2)) * scaling
    q_pos = torch.arange(history_len - w, history_len, device=keys.device).repeat(g)  # (g*w,)
    hidden = key_pos.unsqueeze(1) > q_pos.view(1, -1, 1)  # (Hkv, g*w, T)
    if alive is not None:
        hidden |= ~alive.unsqueeze(1)
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1).sum(dim=1)


def scores_by_position(
    probs: torch.Tensor, key_pos: torch.Tensor, alive: torch.Tensor | None, history_len: int, w: int
) -> torch.Tensor:
    """Slot scores (Hkv, T) -> scores by history position (Hkv, H - w), float32.

    Each slot's score lands at its position; dead slots and the window itself are dropped."""
    hkv = probs.shape[0]
    prefix = history_len - w
    target = key_pos.clone()
    drop = (target >= prefix) | (target < 0)
    if alive is not None:
        drop |= ~alive
    target[drop] = prefix
    out = torch.zeros(hkv, prefix + 1, dtype=torch.float32, device=probs.device)
    out.scatter_add_(1, target, probs.float())
    return out[:, :prefix]


def reselect(
    q_win: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    alive: torch.Tensor | None,
    history_len: int,
    prompt_budget: int,
    kernel_size: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's choice over the whole history: (slot indices, positions, window scores), each
    (Hkv, prompt_budget).

    Keeps the top (prompt_budget - w) smoothed scores per KV head plus the w window positions;
    all outputs are in ascending position order; the scores are the raw ones (0 for the window).
    Every position < H is in at most one alive slot; positions in none are never kept (and fewer than
    prompt_budget - w may then be kept, when fewer are held).
    """
    w = q_win.shape[1]
    raw = scattered_window_scores(q_win, keys, key_pos, alive, history_len, scaling)
    return choose(raw, key_pos, alive, history_len, w, prompt_budget, kernel_size)


def joined_slots(device_pos: torch.Tensor, cold_pos: torch.Tensor, cold_alive: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The positions (Hkv, T + M) and alive flags of the device slots (every one held) then the cold
    ones; alive is None when there are no cold slots."""
    if not cold_pos.shape[1]:
        return device_pos, None
    alive = torch.cat([torch.ones_like(device_pos, dtype=torch.bool), cold_alive], dim=1)
    return torch.cat([device_pos, cold_pos], dim=1), alive


def choose_over_parts(
    probs: torch.Tensor,
    device_pos: torch.Tensor,
    cold_pos: torch.Tensor,
    cold_alive: torch.Tensor,
    history_len: int,
    w: int,
    prompt_budget: int,
    kernel_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's choice over the device slots (positions device_pos (Hkv, T), every one held) and the
    cold slots read beside them (cold_pos, cold_alive (Hkv, M); M may be 0), from each slot's window
    probability probs (Hkv, T + M): as ``choose`` returns, its slots into [device slots, cold slots]."""
    key_pos, alive = joined_slots(device_pos, cold_pos, cold_alive)
    raw = scores_by_position(probs, key_pos, alive, history_len, w)
    return choose(raw, key_pos, alive, history_len, w, prompt_budget, kernel_size)


def choose(
    raw: torch.Tensor,
    key_pos: torch.Tensor,
    alive: torch.Tensor | None,
    history_len: int,
    w: int,
    prompt_budget: int,
    kernel_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's choice from raw scores by position (Hkv, H - w): (slot indices, positions, scores),
    each (Hkv, kept), as ``reselect`` returns them."""
    hkv = key_pos.shape[0]
    device = key_pos.device
    # Inverse map position -> slot, from the alive slots only.
    slot_of = torch.full((hkv, history_len + 1), -1, dtype=torch.long, device=device)
    target = key_pos.clamp(0, history_len) if alive is None else torch.where(alive, key_pos, history_len)
    slots = torch.arange(key_pos.shape[1], device=device).expand(hkv, -1)
    slot_of.scatter_(1, target, slots)
    # A position no slot holds (a cold token not read this turn) cannot be kept; with every
    # position held (the whole history given) this changes nothing.
    held = slot_of[:, : history_len - w] >= 0
    keep = min(prompt_budget - w, int(held.sum(dim=1).min()))
    smoothed = smooth(raw, kernel_size).masked_fill(~held, float("-inf"))
    window = torch.arange(history_len - w, history_len, device=device).expand(hkv, w)
    prefix = select_top(smoothed, keep)
    positions = torch.cat([prefix, window], dim=1)
    return torch.gather(slot_of, 1, positions), positions, kept_scores(raw, prefix, w)
