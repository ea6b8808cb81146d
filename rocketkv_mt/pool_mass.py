"""The window mass of a pool of sketched cold tokens, from the window rows' logits over them (torch).

Each window row's softmax runs over the device's keys and the pool's alive slots. Taken relative to the
row's log-sum-exp over the device (``lse_dev``), the pool's exponentials sum to ``s``: the row's whole
normaliser is lse_dev + log(1 + s), and a slot's share of the row is its exponential / (1 + s). No row
maximum is needed: the device's part holds the row's own token, so ``lse_dev`` is finite and no
smaller than any of its logits, and a cold logit above it by more than ``CAP`` would outweigh the
whole device e**60 times (kept finite, it still ranks first).

Shapes: Hkv KV heads, R window rows per head (the group's query heads times the window), m pool slots.
"""
from __future__ import annotations

import torch

# Shares below exp(-43) (2e-19) of the device's mass rank nothing; floored there, they and their
# products with a row's weight stay normal floats. On the CPU an exp that underflows to a subnormal
# (or of -inf), and any product of subnormals, leaves the vector path: many times slower.
FLOOR = -43.0
CAP = 60.0


def pool_mass(logits: torch.Tensor, alive: torch.Tensor, lse_dev: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp over the device and the pool's alive slots, (Hkv, R) float32; adds to
    ``mass`` (Hkv, m) float32 each alive slot's softmax mass summed over the rows.

    logits (Hkv, R, m) float32 or bfloat16: q.k * scaling; alive (Hkv, m) bool; lse_dev (Hkv, R) float32."""
    share = (logits.float() - lse_dev.unsqueeze(-1)).clamp_(FLOOR, CAP).exp_().mul_(alive.unsqueeze(1))
    total = share.sum(dim=-1)
    mass.unsqueeze(1).baddbmm_((1.0 / (1.0 + total)).unsqueeze(1), share)
    return lse_dev + torch.log1p(total)
