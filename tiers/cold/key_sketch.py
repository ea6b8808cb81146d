"""A few bits per key channel, within the page's digest: enough to estimate every cold token's Stage-1
score without reading its page.

A page's digest already holds each channel's range [kmin, kmax] over its tokens (as KIVI quantizes keys:
per channel, in groups of tokens, because their outliers sit in fixed channels). The sketch adds, per
token and channel, which of 2**bits equal steps of that range the key falls in, packed 8 // bits codes to
a byte. Read back, a key is the middle of its step, off by at most half a step: the window's logits over
the sketch are close enough to rank tokens as the exact ones do, for d * bits / 8 bytes a token instead
of the key's and value's 2 * d * itemsize. Shapes: m pages, P tokens per page, d head dim (a multiple of
8 // bits), c = d * bits // 8.
"""
from __future__ import annotations

import torch

BITS = (2, 4)


def codes_per_byte(bits: int, d: int) -> int:
    """8 // bits, once bits and the head dim d are known to pack (ValueError otherwise)."""
    if bits not in BITS:
        raise ValueError(f"a key sketch has 2 or 4 bits per channel, not {bits}")
    per_byte = 8 // bits
    if d % per_byte:
        raise ValueError(f"head dim {d} is not a multiple of {per_byte}, the codes of one byte")
    return per_byte


def encode(keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes (m, P, c) uint8 of keys (m, P, d) within their pages' bounds kmin/kmax (m, d)."""
    m, p, d = keys.shape
    per_byte = codes_per_byte(bits, d)
    levels = 1 << bits
    lo, span = kmin.float().unsqueeze(1), (kmax.float() - kmin.float()).unsqueeze(1)
    step = torch.where(span > 0, span / levels, torch.ones_like(span))
    codes = ((keys.float() - lo) / step).floor().clamp_(0, levels - 1).to(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=keys.device)
    return (codes.view(m, p, d // per_byte, per_byte) << shifts).sum(dim=-1, dtype=torch.uint8)


def decode(codes: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, bits: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Estimated keys (..., P, d) in ``dtype``, computed in float32, from codes (..., P, c) and bounds (..., d)."""
    d = kmin.shape[-1]
    per_byte = codes_per_byte(bits, d)
    # Every byte value's codes, unpacked and centred in their steps: one table lookup per byte instead
    # of a shift, a mask and a conversion per code (the decode runs over a whole pool every turn).
    byte = torch.arange(256, device=codes.device).unsqueeze(1)
    table = ((byte >> torch.arange(0, 8, bits, device=codes.device)) & ((1 << bits) - 1)).float() + 0.5
    steps = torch.nn.functional.embedding(codes.long(), table).view(*codes.shape[:-1], per_byte * codes.shape[-1])
    lo = kmin.float().unsqueeze(-2)
    return steps.mul_((kmax.float().unsqueeze(-2) - lo) / (1 << bits)).add_(lo).to(dtype)


def nbytes_per_token(head_dim: int, bits: int) -> int:
    """c: the sketch's bytes per token and KV head (0 without a sketch)."""
    return head_dim * bits // 8
