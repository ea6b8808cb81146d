"""Triton kernels for the hot paths; each mirrors a torch reference (callers go through ``rocketkv_mt.dispatch``).

- ``page_scores``: HSA page scoring over the KT min/max cache (reference: ``rocketkv_mt.hsa.page_scores``).
- ``sparse_attention`` / ``sparse_attention_batched``: exact decode attention over gathered tokens
  (reference: ``rocketkv_mt.hsa.sparse_attention``).
- ``window_scores``: Stage-1 observation-window scoring (reference: ``rocketkv_mt.stage1.window_scores``).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when this package is first
imported: set it before that to run the kernels on CPU tensors (tests do).
"""
from __future__ import annotations

import os

import torch

# Captured at the same moment the kernels below are decorated, so it says how they were built.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def check_tensors(*tensors: torch.Tensor) -> None:
    """Fail early with a readable message instead of a driver error deep inside a launch."""
    if INTERPRETED:
        return
    for t in tensors:
        if not t.is_cuda:
            raise RuntimeError(
                "Triton kernels need CUDA tensors; for CPU tensors use backend='torch', or set "
                "TRITON_INTERPRET=1 before rocketkv_mt.kernels is first imported"
            )


def dot_options(dtype: torch.dtype, fp32_precision: str = "ieee") -> dict:
    """Constexpr options for ``tl.dot`` on operands of ``dtype``: UPCAST to fp32 first, and PRECISION.

    The interpreter's dot multiplies bfloat16 storage (uint16) as integers, so there operands are up-cast.
    On a GPU, fp32 operands must not drop to plain TF32 (the references compute in fp32): they use
    ``fp32_precision`` ("ieee", or "tf32x3" where IEEE tiles would spill registers); 16-bit operands are
    multiplied natively with fp32 accumulation (exact products, like the reference's up-cast matmul).
    """
    if INTERPRETED:
        return {"UPCAST": True, "PRECISION": "ieee"}
    return {"UPCAST": False, "PRECISION": fp32_precision if dtype == torch.float32 else "ieee"}


from .page_scores import page_scores  # noqa: E402
from .sparse_decode import sparse_attention, sparse_attention_batched  # noqa: E402
from .window_scores import window_scores  # noqa: E402

__all__ = [
    "INTERPRETED",
    "page_scores",
    "sparse_attention",
    "sparse_attention_batched",
    "window_scores",
]
