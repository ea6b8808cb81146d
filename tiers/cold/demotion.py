"""A cold layer's demotion (``tiers.cold.layer``, the ``layer`` argument), staged for ``ColdLayer.commit``
to enter: which tokens share a new page (in position order, or grouped by their keys), the pages' bytes
written to the host tier, and their digests and sketches for the page table.

Shapes: Hkv KV heads, L tokens a head, P tokens per page, d head dim, m new pages.
"""
from __future__ import annotations

import torch

from tiers.cold import key_sketch
from tiers.cold.page_grouping import group_by_keys
from tiers.cold.table import DIGEST_DTYPE, Demotion, outward


def stage(layer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
          mask: torch.Tensor) -> Demotion:
    """Write the new pages of a demotion of the tokens where mask (Hkv, L) is set, and return it for
    ``commit``: a failed write (``HostFull``, a store that cannot take a spill) leaves the page table as it
    was, so a caller may stage every fallible step of a move before it changes anything. keys/values (Hkv,
    L, d), positions (Hkv, L). Tokens with a page slot already (promoted earlier) become cold again in place;
    the others go to new pages, by position or grouped by keys (``by_keys``, ``tiers.cold.page_grouping``).
    Every head at once: a short turn demotes a few pages a head, and per-head steps cost more than the bytes."""
    p, hkv = layer.page_tokens, mask.shape[0]
    mask, pos_cpu = mask.cpu(), positions.cpu()
    slots = layer._slots_at(pos_cpu)
    staged = Demotion(torch.where(mask, pos_cpu, -1), torch.where(mask, slots, -1))
    fresh = mask & (slots < 0)
    counts = fresh.sum(dim=1)
    if not bool(counts.any()):
        return staged
    # The fresh tokens, head by head, in the order their pages take them: (head, store index) each.
    if layer.by_keys and bool((counts > p).any()):
        order = _grouped(layer, keys, [torch.nonzero(fresh[i]).flatten() for i in range(hkv)])
        token_head = torch.repeat_interleave(torch.arange(hkv), counts)
        token_at = torch.cat(order)
    else:
        token_head, token_at = torch.nonzero(fresh).unbind(1)
    pages = (counts + p - 1) // p
    page_head = torch.repeat_interleave(torch.arange(hkv), pages)
    first_page = torch.cumsum(pages, 0) - pages
    first_token = torch.cumsum(counts, 0) - counts
    # Each page slot's token; a head's last page is padded with its last token's key (which keeps the
    # page's bounds), a zero value and position -1.
    m = int(pages.sum())
    dest = first_page[token_head] * p + torch.arange(token_at.numel()) - first_token[token_head]
    taken = torch.full((m * p,), -1, dtype=torch.long)
    taken[dest] = torch.arange(token_at.numel())
    pad = taken < 0
    filled = torch.where(pad, -1, torch.arange(m * p)).cummax(0).values  # a head's pages start with a token
    src = taken[filled]
    head_of, at = token_head[src], token_at[src]
    pos = torch.where(pad, -1, pos_cpu[head_of, at]).view(m, p)
    head_of, at = head_of.to(keys.device), at.to(keys.device)
    k = keys[head_of, at].view(m, p, -1)
    v = values[head_of, at].masked_fill(pad.to(keys.device).unsqueeze(-1), 0).view(m, p, -1)
    # Fresh ids even after a failed write: a spill of its first part may still be under way in the host tier.
    ids = layer.namer.take(layer.layer, m)
    encoded = layer.codec.encode(k, v)
    # Bounds of the keys a fetch gives back (with int8 these differ from k by up to half a step).
    stored, stored_v = layer.codec.decode(encoded, layer.dtype)
    kmin, kmax = outward(stored.amin(dim=1).cpu(), up=False), outward(stored.amax(dim=1).cpu(), up=True)
    codes = _encode_sketch(layer, stored, kmin, kmax)
    vsketch = _sketch_values(layer, stored_v, pos)
    try:
        staged.written = layer.host.put_many(layer.session_id, ids, encoded)
    except BaseException:
        # ``put_many`` takes back what it stored when it finds no room; on any other failure this does.
        layer.host.free_many(layer.session_id, ids)
        raise
    staged.ids, staged.pages = ids, (page_head, pos, kmin, kmax, codes, vsketch)
    return staged


def _sketch_values(layer, values: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pages' value sketch: codes (m, P, c) within value bounds (m, d) taken over real tokens (pos (m, P) >= 0)
    and rounded outward; widths 0 without a sketch. values (m, P, d) as a fetch gives them back."""
    m, p, d = values.shape
    if not layer.sketch_bits:
        return (torch.zeros(m, p, 0, dtype=torch.uint8), torch.zeros(m, 0, dtype=DIGEST_DTYPE),
                torch.zeros(m, 0, dtype=DIGEST_DTYPE))
    v = values.cpu().float()
    real = (pos >= 0).unsqueeze(-1)
    vmin = outward(torch.where(real, v, float("inf")).amin(dim=1), up=False)
    vmax = outward(torch.where(real, v, float("-inf")).amax(dim=1), up=True)
    return key_sketch.encode(v, vmin, vmax, layer.sketch_bits), vmin, vmax


def _encode_sketch(layer, keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Sketch codes (m, P, c) of pages' keys (m, P, d) within their stored bounds; c = 0 without one."""
    if not layer.sketch_bits:
        return torch.zeros(*keys.shape[:2], 0, dtype=torch.uint8)
    return key_sketch.encode(keys.cpu(), kmin, kmax, layer.sketch_bits)


def _grouped(layer, keys: torch.Tensor, fresh_of: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each head's fresh slots reordered so that its pages hold similar keys (all heads at once)."""
    counts = [int(f.numel()) for f in fresh_of]
    picked = torch.cat([keys[i].index_select(0, f.to(keys.device)) for i, f in enumerate(fresh_of)])
    order = group_by_keys(picked, layer.page_tokens, counts).cpu()
    flat = torch.cat(fresh_of)[order]
    return list(flat.split(counts))
