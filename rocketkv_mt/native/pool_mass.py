"""The native pool mass (``pool_mass.c``): ``rocketkv_mt.pool_mass.pool_mass`` in one pass per row."""
from __future__ import annotations

import torch

from rocketkv_mt.native import library
from rocketkv_mt.pool_mass import CAP, FLOOR


def supports(logits: torch.Tensor) -> bool:
    """True when the kernel can take these logits: float32 or bfloat16 on the CPU, a library built here."""
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and library() is not None


def pool_mass(logits: torch.Tensor, alive: torch.Tensor, lse_dev: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """As ``rocketkv_mt.pool_mass.pool_mass``; pass ``supports(logits)`` first."""
    hkv, rows, m = logits.shape
    # The kernel trusts these: a mismatch would read or write outside the tensors, not raise.
    if alive.shape != (hkv, m) or lse_dev.shape != (hkv, rows) or mass.shape != (hkv, m):
        raise ValueError(f"alive {tuple(alive.shape)}, lse_dev {tuple(lse_dev.shape)} or mass {tuple(mass.shape)} "
                         f"do not match logits {tuple(logits.shape)}")
    if mass.dtype != torch.float32 or not mass.is_contiguous() or mass.device.type != "cpu":
        raise ValueError("the pool mass accumulates into a contiguous float32 CPU tensor")
    # Rows contiguous, heads evenly apart: a slice of a padded product's rows is read in place.
    if logits.stride(2) != 1 or logits.stride(1) != m or logits.stride(0) % max(m, 1) or logits.stride(0) < rows * m:
        logits = logits.contiguous()
    row_stride = logits.stride(0) // m if m else rows
    live = alive.to(torch.uint8).contiguous()
    lse_dev = lse_dev.float().contiguous()
    lse = torch.empty_like(lse_dev)
    rc = library().rkv_pool_mass(logits.data_ptr(), int(logits.dtype == torch.bfloat16), row_stride, live.data_ptr(),
                                 lse_dev.data_ptr(), lse.data_ptr(), mass.data_ptr(), hkv, rows, m, FLOOR, CAP)
    if rc != 0:
        raise MemoryError("native pool_mass could not allocate its scratch row")
    return lse
