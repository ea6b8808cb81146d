"""Pick the Triton kernel, the native CPU kernel or the torch reference for each hot path, per call.

Every function takes ``backend``: "auto" (Triton for CUDA tensors when triton is installed; for HSA's
decode step, a sketch pool's mass, Stage 1's choice over slots and a prefill chunk's attention on CPU
tensors, the native C kernels when they build here; torch otherwise), "triton" (always the kernel; on
CPU tensors only when TRITON_INTERPRET=1 was set before the kernels were first imported), "native"
(those on the C kernels, torch for the other paths) or "torch" (always the reference). The choice is an argument, not module state, so two engines with different
settings can share a process (the app passes its ``kernels`` setting).
"""
from __future__ import annotations

import functools
import importlib.util

import numpy as np
import torch

from . import hsa, pool_mass as torch_pool_mass, stage1
from . import reselect as _reselect
from .native import attend_rows as native_rows
from .native import hsa as native_hsa
from .native import pool_mass as native_pool_mass
from .native import softmax_rows as native_softmax
from .native import stage1_choose as native_choose

BACKENDS = ("auto", "torch", "triton", "native")


def uses_triton(backend: str, tensor: torch.Tensor) -> bool:
    if backend in ("torch", "native"):
        return False
    if backend == "triton":
        return True
    if backend == "auto":
        return tensor.is_cuda and importlib.util.find_spec("triton") is not None
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")


def _kernels():
    # Imported on first use: CPU-only installs never load triton, and TRITON_INTERPRET (read when the
    # kernels are decorated) can still be set by the caller before that.
    from . import kernels

    return kernels


def window_scores(q_win: torch.Tensor, keys: torch.Tensor, scaling: float, *, backend: str = "auto") -> torch.Tensor:
    """Stage-1 scores: q_win (Hq, W, d), keys (Hkv, L, d) -> float32 (Hkv, L - W). See ``stage1.window_scores``."""
    if uses_triton(backend, keys):
        return _kernels().window_scores(q_win, keys, scaling)
    return stage1.window_scores(q_win, keys, scaling)


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, **where
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill attention on the Triton kernel, with each row's log-sum-exp: ``kernels.attend_rows``
    (q (Hq, n, d), keys/values (Hkv, T, d) -> out (Hq, n, d), lse (Hq, n)); CUDA tensors, or CPU ones
    when the kernels are interpreted. Callers check ``uses_triton`` first."""
    return _kernels().attend_rows(q, keys, values, scaling, **where)


def native_takes_rows(backend: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``causal_rows`` runs these CPU tensors on the native C kernel (float32, each head's key
    rows contiguous, head dim 64 or 128), where it is allowed and builds here."""
    return backend in ("auto", "native") and native_rows.supports(q, keys, values)


def causal_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """``attention_ops.dense_attention`` of CPU tensors on the native kernel: q (Hq, n, d) the last n of
    the L keys' queries, keys/values (Hkv, L, d) -> (Hq, n, d). Callers check ``native_takes_rows``."""
    return native_rows.attend_rows(q, keys, values, scaling)


def part_logits(q: torch.Tensor, keys: torch.Tensor, scaling: float, *, backend: str = "auto") -> torch.Tensor:
    """scaling * q (Hkv, M, d) . keys (Hkv, T, d)^T -> float32 (Hkv, M, T): on the native kernel (float32
    CPU tensors, contiguous key rows) where it is allowed and builds here, else one batched product."""
    if backend in ("auto", "native") and native_rows.takes_rows(q, keys):
        return native_rows.part_logits(q, keys, scaling)
    return torch.matmul(q.float(), keys.float().transpose(1, 2)).mul_(scaling)


def takes_part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, backend: str = "auto") -> bool:
    """Whether ``whole_part`` can run these tensors on the native kernel (float32 CPU tensors, contiguous
    key and value rows, a head dim it takes) and ``backend`` allows it."""
    return backend in ("auto", "native") and native_rows.supports(q, keys, values)


def whole_part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, w: int, own_tail: int,
               visible: torch.Tensor | None, first_row: int):
    """An attention part in one native call: ``native.attend_rows.part``. Ask ``takes_part`` first."""
    return native_rows.part(q, keys, values, scaling, w, own_tail, visible, first_row)


def part_values(probs: torch.Tensor, values: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """probs (Hkv, M, T) float32 . values (Hkv, T, d) -> (Hkv, M, d): native where ``part_logits`` is."""
    if backend in ("auto", "native") and native_rows.takes_rows(probs, values):
        return native_rows.part_values(probs, values)
    return torch.matmul(probs, values.float())


def page_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, channels: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """HSA page scores: q (Hkv, G, d), kmin/kmax (Hkv, P, d), channels (Hkv, r) -> float32 (Hkv, P).

    Sessions with the same page count batch by flattening (B, Hkv) into the first axis.
    See ``hsa.page_scores``.
    """
    if uses_triton(backend, q):
        return _kernels().page_scores(q, kmin, kmax, channels)
    return hsa.page_scores(q, kmin, kmax, channels)


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention of q (Hkv, G, d) over tokens/valid (Hkv, T) of keys/values (Hkv, L, d) -> (Hkv, G, d)."""
    if uses_triton(backend, q):
        return _kernels().sparse_attention(q, keys, values, tokens, valid, scaling)
    return hsa.sparse_attention(q, keys, values, tokens, valid, scaling)


def sparse_attention_batched(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Batched sparse decode over sessions -> (B, Hkv, G, d).

    q (B, Hkv, G, d); keys/values (B, Hkv, Lmax, d); tokens/valid (B, Hkv, T).

    Tokens index each session's own rows; rows past a session's length are never read if its tokens
    stay below it. The torch path runs the reference once over the flattened (B * Hkv) heads.
    """
    if uses_triton(backend, q):
        return _kernels().sparse_attention_batched(q, keys, values, tokens, valid, scaling)
    bsz, hkv = q.shape[:2]
    out = hsa.sparse_attention(
        q.flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1), tokens.flatten(0, 1), valid.flatten(0, 1), scaling
    )
    return out.view(bsz, hkv, *out.shape[1:])


def hsa_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_size: int,
    topr: int,
    topk: int,
    scaling: float,
    *,
    local_window: int = 0,
    pinned: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``hsa.hsa_attention`` with its two heavy steps (page scoring, sparse attention) dispatched."""
    return hsa.hsa_attention(
        q, keys, values, kmin, kmax, page_size, topr, topk, scaling,
        score_pages=functools.partial(page_scores, backend=backend),
        attend=functools.partial(sparse_attention, backend=backend),
        local_window=local_window,
        pinned=pinned,
    )


def hsa_decode(
    q: torch.Tensor,
    key_buf: torch.Tensor,
    value_buf: torch.Tensor,
    length: int,
    bounds: torch.Tensor,
    page_size: int,
    topr: int,
    topk: int,
    scaling: float,
    *,
    local_window: int = 0,
    pinned: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """HSA's decode step over a layer's cache buffers, q (Hkv, G, d) -> (Hkv, G, d); the arguments are
    ``hsa.hsa_decode``'s.

    Triton kernels where ``backend`` picks them (they read the kept keys and the KT bounds as strided
    min/max views, nothing copied), the native C kernel where it is allowed and can take the tensors,
    else the torch path.
    """
    if uses_triton(backend, q):
        d = q.shape[-1]
        return hsa_attention(
            q, key_buf[:, :length], value_buf[:, :length],
            bounds[:, d:].transpose(1, 2), bounds[:, :d].transpose(1, 2),
            page_size, topr, topk, scaling, local_window=local_window, pinned=pinned, backend=backend,
        )
    args = (q, key_buf, value_buf, length, bounds, page_size, topr, topk, scaling, local_window, pinned)
    if backend in ("auto", "native"):
        if native_hsa.supports(q):
            return native_hsa.hsa_decode(*args)
        if backend == "native":
            raise RuntimeError("the native HSA kernel needs float32 CPU tensors and a C compiler on this machine")
    return hsa.hsa_decode(*args)


def pool_mass(logits: torch.Tensor, alive: torch.Tensor, lse_dev: torch.Tensor, mass: torch.Tensor, *,
              backend: str = "auto") -> torch.Tensor:
    """The window rows' normalisers over the device and a pool of sketched tokens, adding each slot's
    window mass to ``mass``: ``rocketkv_mt.pool_mass.pool_mass``, on the native C kernel (CPU, float32
    or bfloat16 logits) where it is allowed and builds here."""
    if backend in ("auto", "native"):
        if native_pool_mass.supports(logits):
            return native_pool_mass.pool_mass(logits, alive, lse_dev, mass)
        if backend == "native":
            raise RuntimeError("the native pool mass needs float32 or bfloat16 CPU logits and a C compiler here")
    return torch_pool_mass.pool_mass(logits, alive, lse_dev, mass)


def softmax_rows(logits: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite logits (..., n) with exp(logit - row max); return (row max, row sum), each (..., 1), the
    max 0 for a row with every logit -inf: on the native C kernel (contiguous float32 CPU logits) where
    it is allowed and builds here, else in torch."""
    if backend in ("auto", "native"):
        if native_softmax.supports(logits):
            return native_softmax.softmax_rows(logits)
        if backend == "native":
            raise RuntimeError("the native softmax needs contiguous float32 CPU logits and a C compiler here")
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return top, logits.sub_(top).exp_().sum(dim=-1, keepdim=True)


def choose_slots(
    probs: torch.Tensor, key_pos: torch.Tensor, alive: torch.Tensor | None, history_len: int, w: int,
    prompt_budget: int, kernel_size: int, *, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's choice from each slot's window probability probs (Hkv, S) at positions key_pos (Hkv, S)
    (``alive`` (Hkv, S) or None): ``reselect.scores_by_position`` then ``reselect.choose``, in one call of
    the native C kernel (float32 CPU scores, none NaN) where it is allowed and builds here."""
    if backend in ("auto", "native") and native_choose.supports(probs):
        return native_choose.choose(probs, key_pos, alive, history_len, w, prompt_budget, kernel_size)
    if backend == "native":
        raise RuntimeError("the native Stage-1 choice needs float32 CPU scores (no NaN) and a C compiler here")
    raw = _reselect.scores_by_position(probs, key_pos, alive, history_len, w)
    return _reselect.choose(raw, key_pos, alive, history_len, w, prompt_budget, kernel_size)


def choose_over_parts(
    probs: torch.Tensor, device_pos: torch.Tensor, cold_pos: torch.Tensor, cold_alive: torch.Tensor,
    history_len: int, w: int, prompt_budget: int, kernel_size: int, *, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's choice over the device slots and cold slots beside them: ``reselect.choose_over_parts``,
    through ``choose_slots``."""
    key_pos, alive = _reselect.joined_slots(device_pos, cold_pos, cold_alive)
    return choose_slots(probs, key_pos, alive, history_len, w, prompt_budget, kernel_size, backend=backend)


def reselect(
    q_win: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, alive: torch.Tensor | None, history_len: int,
    prompt_budget: int, kernel_size: int, scaling: float, *, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's choice over a whole history held in any order: ``reselect.reselect``, through
    ``choose_slots``."""
    probs = _reselect.window_slot_probs(q_win, keys, key_pos, alive, history_len, scaling)
    return choose_slots(probs, key_pos, alive, history_len, q_win.shape[1], prompt_budget, kernel_size,
                        backend=backend)


def decode_batch_kind(backend: str, q: torch.Tensor) -> str | None:
    """Which kernel runs one layer's decode step of many sessions in one call (``decode_batch``) for
    tensors like ``q``: "triton" (CUDA, or CPU when the kernels are interpreted and asked for),
    "native" (float32 CPU with the C kernel built) or None (each session attends alone)."""
    if backend == "torch":
        return None
    if uses_triton(backend, q):
        return "triton"
    if backend in ("auto", "native") and native_hsa.supports(q):
        return "native"
    return None


def decode_batch(
    rows: np.ndarray,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scaling: float,
    *,
    kind: str,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's decode step of B sessions in one kernel call -> (B, Hkv, G, d).

    rows (B, ``decode_table.WIDTH``) int64: each session's buffers, token and attention
    (``rocketkv_mt.cache.decode_target.DecodeTarget.row``); ``table``: the same rows on q's device (Triton
    reads them there). q (B, Hkv, G, d); k_new/v_new (B, Hkv, d). ``kind`` from ``decode_batch_kind``.
    The call shows in a torch profile as ``rkv::decode_batch``.
    """
    with torch.profiler.record_function("rkv::decode_batch"):
        if kind == "native":
            return native_hsa.decode_batch(rows, q, k_new, v_new, scaling)
        if kind == "triton":
            return _kernels().decode_batch(table if table is not None else torch.from_numpy(rows), rows, q, k_new,
                                           v_new, scaling)
    raise ValueError(f"no batched decode kernel {kind!r}")
