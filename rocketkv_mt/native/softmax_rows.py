"""The native softmax numerators (``softmax_rows.c``): exp(logits - row max) in place, with each row's
max and sum, as ``rocketkv_mt.split_attention`` computes them in torch."""
from __future__ import annotations

import torch

from rocketkv_mt.native import library


def supports(logits: torch.Tensor) -> bool:
    """True when the kernel can take these logits: contiguous float32 on the CPU, a library built here."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and library() is not None)


def softmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite logits (..., n) with exp(logit - top) and return (top, sum), each (..., 1): top each
    row's max (0 where every logit is -inf), sum its row of exponentials. Pass ``supports`` first."""
    if not supports(logits):
        raise ValueError("the native softmax needs contiguous float32 CPU logits and a C compiler here")
    n = logits.shape[-1]
    rows = logits.numel() // n if n else 0
    top = torch.empty(*logits.shape[:-1], 1, dtype=torch.float32)
    total = torch.empty_like(top)
    library().rkv_softmax_rows(logits.data_ptr(), rows, n, top.data_ptr(), total.data_ptr())
    return top, total
