"""Triton kernels for the hot paths; each mirrors a torch reference (callers go through ``rocketkv_mt.dispatch``).

- ``page_scores``: HSA page scoring over the KT min/max cache (reference: ``rocketkv_mt.hsa.page_scores``).
- ``sparse_attention`` / ``sparse_attention_batched``: exact decode attention over gathered tokens
  (reference: ``rocketkv_mt.hsa.sparse_attention``).
- ``window_scores``: Stage-1 observation-window scoring (reference: ``rocketkv_mt.stage1.window_scores``).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when this package is first
imported: set it before that to run the kernels on CPU tensors (tests do).
"""
from __future__ import annotations

from .common import INTERPRETED, check_tensors, dot_options
from .page_scores import page_scores
from .sparse_decode import sparse_attention, sparse_attention_batched
from .window_scores import window_scores

__all__ = [
    "INTERPRETED",
    "check_tensors",
    "dot_options",
    "page_scores",
    "sparse_attention",
    "sparse_attention_batched",
    "window_scores",
]
