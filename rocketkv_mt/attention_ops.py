"""Dense attention used for prefill (and for decode in uncompressed modes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Query rows per SDPA call during prefill: bounds the (rows x keys) score buffer on long prompts.
PREFILL_ROWS = 1024


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of the last n keys' queries over all keys.

    q: (Hq, n, d), the queries of the last n of the L keys; keys/values: (Hkv, L, d).
    Returns (Hq, n, d). Query i sits at position L - n + i and sees keys 0..L - n + i.
    """
    hq, n, _ = q.shape
    length = keys.shape[1]
    k, v = keys.unsqueeze(0), values.unsqueeze(0)
    if n == 1:
        return F.scaled_dot_product_attention(q.unsqueeze(0), k, v, scale=scaling, enable_gqa=True)[0]
    out = torch.empty_like(q)
    for start in range(0, n, PREFILL_ROWS):
        stop = min(n, start + PREFILL_ROWS)
        visible = length - n + stop  # keys beyond the chunk's last query are never seen
        q_pos = torch.arange(length - n + start, length - n + stop, device=q.device).view(-1, 1)
        mask = torch.arange(visible, device=q.device).view(1, -1) <= q_pos
        out[:, start:stop] = F.scaled_dot_product_attention(
            q[:, start:stop].unsqueeze(0),
            k[:, :, :visible],
            v[:, :, :visible],
            attn_mask=mask,
            scale=scaling,
            enable_gqa=True,
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
) -> torch.Tensor:
    """Attention of queries (Hq, n, d) at positions q_pos (n,) over slots stored in any order.

    keys/values (Hkv, T, d) with positions key_pos (Hkv, T); a query sees the slots at or before its
    position, skipping slots where ``alive`` (Hkv, T) is False. Returns (Hq, n, d).
    """
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
