"""Triton kernels for the hot paths; each mirrors a torch reference (callers go through ``rocketkv_mt.dispatch``).

- ``page_scores``: HSA page scoring over the KT min/max cache (reference: ``rocketkv_mt.hsa.page_scores``).
- ``sparse_attention`` / ``sparse_attention_batched``: exact decode attention over gathered tokens
  (reference: ``rocketkv_mt.hsa.sparse_attention``).
- ``window_scores``: Stage-1 observation-window scoring (reference: ``rocketkv_mt.stage1.window_scores``).
- ``attend_rows``: prefill attention over a causal offset or stored positions, with each row's
  log-sum-exp (reference: ``rocketkv_mt.attention_ops``'s torch paths).
- ``decode_batch``: one decode step of a layer for every decoding session at once, each over its own
  cache buffers (reference: ``rocketkv_mt.hsa.hsa_decode`` and dense attention per session).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when this package is first
imported: set it before that to run the kernels on CPU tensors (tests do).
"""
from __future__ import annotations

from .common import INTERPRETED, check_tensors, dot_options
from .decode_batch import decode_batch
from .page_scores import page_scores
from .prefill_attention import attend_rows
from .sparse_decode import sparse_attention, sparse_attention_batched
from .window_scores import window_scores

__all__ = [
    "INTERPRETED",
    "attend_rows",
    "check_tensors",
    "decode_batch",
    "dot_options",
    "page_scores",
    "sparse_attention",
    "sparse_attention_batched",
    "window_scores",
]
