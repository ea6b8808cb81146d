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


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether kernels should up-cast dot operands to fp32 (and use IEEE precision).

    fp32 inputs must not silently drop to TF32 (the references compute in fp32). The interpreter's
    dot reinterprets bfloat16 storage (uint16) as integers, so there every operand is up-cast too.
    """
    return INTERPRETED or dtype == torch.float32


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
