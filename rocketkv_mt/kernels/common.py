"""What every Triton kernel here shares: whether they run interpreted, tensor checks, ``tl.dot`` options.

A module of its own (not the package's ``__init__``), so that the kernels import it and the package
imports the kernels, one way.
"""
from __future__ import annotations

import os

import torch

# Captured on the first import of the package, when its kernels are decorated: it says how they were built.
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
