"""Dense attention used for prefill (and for decode in uncompressed modes).

On CUDA no path builds a mask or a (rows x keys) score matrix: a turn over a contiguous history is
causal with an offset (query i of n sits at position L - n + i), which flash attention runs as a
bottom-right causal mask with the GQA group handled by the kernel; where flash cannot take the call
(fp32, an older torch) and for slots stored in any order, the Triton kernel ``kernels.attend_rows``
streams the keys with an online softmax. On CPU a few rows (a chunk) go through the native kernel,
which does the same on the CPU; more rows go through SDPA in blocks with an explicit boolean mask,
which bounds the scores to one block. ``prefill_scratch_bytes`` says what each path
allocates besides its output, for the device-memory bound.

Shapes: Hq query heads, Hkv KV heads, G = Hq / Hkv, n queries, L (or T) keys, d head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from rocketkv_mt import dispatch

# Query rows per SDPA call on CPU: bounds the (rows x keys) score buffer on long prompts.
PREFILL_ROWS = 1024
# Up to this many query rows, a CPU prefill attends on the native kernel (``native/attend_rows.c``):
# a chunk fed beside decode tokens, over a long history, where SDPA with a mask ran at 15-30 GFLOPS.
# Longer prefills keep SDPA where it has several intra-op threads (the kernel runs on one); with one,
# the kernel takes them too (1.3-2.3x faster than SDPA from 64 to 512 rows on an AVX2 machine), so
# that a chunk's cost does not jump where it crosses this count.
NATIVE_ROWS = 64


def dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, *, backend: str = "auto"
) -> torch.Tensor:
    """Causal attention of the last n keys' queries over all keys.

    q: (Hq, n, d), the queries of the last n of the L keys; keys/values: (Hkv, L, d).
    Returns (Hq, n, d). Query i sits at position L - n + i and sees keys 0..L - n + i.
    """
    hq, n, d = q.shape
    hkv, length, _ = keys.shape
    if n == 1 and q.is_cuda:
        # The group's G query heads as G query rows of their KV head: no mask and no GQA flag, so
        # flash or memory-efficient attention takes it in any dtype.
        out = F.scaled_dot_product_attention(
            q.reshape(1, hkv, hq // hkv, d), keys.unsqueeze(0), values.unsqueeze(0), scale=scaling
        )
        return out.view(hq, 1, d)
    if n == 1:
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale=scaling, enable_gqa=True
        )[0]
    if flash_takes(q, keys, values):
        return causal_sdpa(q, keys, values, scaling)
    if dispatch.uses_triton(backend, q):
        return dispatch.attend_rows(q, keys, values, scaling, q_offset=length - n)[0]
    if (n <= NATIVE_ROWS or torch.get_num_threads() == 1) and dispatch.native_takes_rows(backend, q, keys, values):
        return dispatch.causal_rows(q, keys, values, scaling)
    return _masked_rows(q, keys, values, scaling)


def flash_takes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether flash attention runs ``causal_sdpa`` on these tensors (never on CPU tensors)."""
    if not q.is_cuda:
        return False
    gqa = q.shape[0] != keys.shape[0]
    try:
        params = SDPAParams(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), None, 0.0, False, gqa)
    except TypeError:  # a torch whose SDPA knows no GQA flag
        return False
    return bool(can_use_flash_attention(params))


def causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """``dense_attention`` as one SDPA call with a bottom-right causal bias (no materialised mask
    where flash attention takes it: check ``flash_takes``; elsewhere SDPA builds the mask)."""
    hq, n, _ = q.shape
    hkv, length, _ = keys.shape
    return F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=causal_lower_right(n, length), scale=scaling, enable_gqa=hq != hkv,
    )[0]


def _masked_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    hq, n, _ = q.shape
    length = keys.shape[1]
    k, v = keys.unsqueeze(0), values.unsqueeze(0)
    out = torch.empty_like(q)
    for start in range(0, n, PREFILL_ROWS):
        stop = min(n, start + PREFILL_ROWS)
        visible = length - n + stop  # keys beyond the block's last query are never seen
        q_pos = torch.arange(length - n + start, length - n + stop, device=q.device).view(-1, 1)
        mask = torch.arange(visible, device=q.device).view(1, -1) <= q_pos
        out[:, start:stop] = F.scaled_dot_product_attention(
            q[:, start:stop].unsqueeze(0), k[:, :, :visible], v[:, :, :visible],
            attn_mask=mask, scale=scaling, enable_gqa=True,
        )[0]
    return out


def positional_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    alive: torch.Tensor | None,
    scaling: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of queries (Hq, n, d) at positions q_pos (n,) over slots stored in any order.

    keys/values (Hkv, T, d) with positions key_pos (Hkv, T); a query sees the slots at or before its
    position, skipping slots where ``alive`` (Hkv, T) is False. Returns (Hq, n, d).
    """
    if dispatch.uses_triton(backend, q):
        return dispatch.attend_rows(q, keys, values, scaling, q_pos=q_pos, key_pos=key_pos, alive=alive)[0]
    hq, n, _ = q.shape
    g = hq // keys.shape[0]
    out = torch.empty_like(q)
    for start in range(0, n, PREFILL_ROWS):
        stop = min(n, start + PREFILL_ROWS)
        mask = key_pos.unsqueeze(1) <= q_pos[start:stop].view(1, -1, 1)  # (Hkv, rows, T)
        if alive is not None:
            mask &= alive.unsqueeze(1)
        out[:, start:stop] = F.scaled_dot_product_attention(
            q[:, start:stop].unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask.repeat_interleave(g, dim=0).unsqueeze(0),
            scale=scaling,
            enable_gqa=True,
        )[0]
    return out


def prefill_scratch_bytes(
    n_rows: int, n_keys: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device | str, *, window: int = 0,
) -> int:
    """Peak temporary bytes of one layer's prefill attention: n_rows queries over n_keys keys.

    CUDA: flash attention and the Triton kernel keep only each row's log-sum-exp (and the merged
    parts of a tiered turn one fp32 output more). CPU: one block of PREFILL_ROWS rows' fp32 scores
    and their softmax, its boolean mask repeated per query head, and the block's output. Both add
    Stage 1's ``window`` rows, scored in full (logits and exponentials, fp32, over an fp32 copy of
    the keys). The output itself (Hq, n, d) is the caller's and not counted.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    window_rows = (2 * q_heads * window * n_keys + kv_heads * n_keys * head_dim) * 4 if window else 0
    if torch.device(device).type == "cuda":
        return q_heads * n_rows * (4 + head_dim * 4) + window_rows
    rows = min(n_rows, PREFILL_ROWS)
    scores = 2 * q_heads * rows * n_keys * 4
    mask = (q_heads + kv_heads) * rows * n_keys
    return scores + mask + q_heads * rows * head_dim * elem + window_rows
