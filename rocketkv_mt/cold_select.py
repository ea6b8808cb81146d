"""Which cold pages a new turn fetches: the ones whose key digests bound Stage 1's score highest.

Stage 1 scores a token by the softmax mass the observation window puts on it. For a cold page with
per-channel key bounds [kmin, kmax], q·k <= sum_c max(q_c kmin_c, q_c kmax_c) for every key in the
page (Quest's bound). The softmax normaliser of each window query is at least the one over the keys
the device already holds (primary set and the new turn), so exp(bound - lse_device) bounds each
query's share of any token of the page; summed over the window and the query heads of the KV group,
it bounds the page's best Stage-1 score. The pages with the highest bounds are fetched.

With a key sketch (``tiers.cold.key_sketch``) every cold token has an estimated key, so Stage 1 can be
run as ``exhaustive`` runs it, over the device's keys and the sketched tokens of a pool of pages
(those whose bounds rank highest), without a page read: the pages holding the tokens that choice keeps are fetched first (``page_picks``), then the pages
whose sketched tokens carry the most window mass. Stage 1 then chooses again, exactly, over what was
read. Pages of consecutive positions suit this: the choice keeps runs of neighbours (its max
pooling), which fill few such pages.

Shapes: Hq query heads, Hkv KV heads, g = Hq / Hkv, w window queries, T device slots, N cold pages
per head, d head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rocketkv_mt import dispatch
from rocketkv_mt.pool_mass import CAP
from rocketkv_mt.split_attention import Part, window_probs
from tiers.cold.table import padded_indices


def page_bounds(q_win: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """Upper bound of each cold page's Stage-1 score: (Hkv, N) float32.

    q_win (Hq, w, d); kmin/kmax (Hkv, N, d); lse (Hkv, g*w): each window row's log-sum-exp over the
    keys on the device (``split_attention``'s first part), rows in q_win.reshape(Hkv, g*w, d) order. The cold pages sit
    before the window (they are history), so every window query may see them."""
    hq, w, d = q_win.shape
    hkv = kmin.shape[0]
    q = q_win.reshape(hkv, (hq // hkv) * w, d).float()
    bound = (q.clamp(min=0) @ kmax.float().transpose(1, 2) + q.clamp(max=0) @ kmin.float().transpose(1, 2)) * scaling
    # exp() of a bound far above the normaliser is still a ranking, not a probability: capped as shares are.
    return torch.exp((bound - lse.unsqueeze(-1)).clamp(max=CAP)).sum(dim=1)


def pages_per_head(fraction: float, prompt_budget: int, page_tokens: int) -> int:
    """Cold pages a ``digest`` turn reads per KV head and layer: ``fraction`` of the prompt budget's tokens."""
    return math.ceil(fraction * prompt_budget / page_tokens)


def candidate_pages(scores: torch.Tensor, live: torch.Tensor, per_head: int) -> torch.Tensor:
    """Per head, the indices (ascending) of at most ``per_head`` live pages with the highest scores:
    (Hkv, n) padded with -1, n the most any head got."""
    hkv, n = scores.shape
    k = min(per_head, n)
    if k == 0:
        return torch.zeros(hkv, 0, dtype=torch.long, device=scores.device)
    top = torch.topk(scores.masked_fill(~live, float("-inf")), k, dim=1).indices
    return padded_indices(torch.zeros_like(live).scatter_(1, top, live.gather(1, top)))


def sketch_dtype(device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """What a pool's estimated keys are decoded to and scored in: the model's dtype on a GPU; on a CPU
    bfloat16 where it multiplies bfloat16 in hardware (AMX, AVX512-BF16: about three times float32's
    rate), else float32. Keys known to four bits a channel lose nothing to bfloat16's eight."""
    if device.type != "cpu":
        return model_dtype
    fast = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() or getattr(
        torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if fast else torch.float32


# Window rows are scored in chunks of a multiple of this many rows, the last one padded: with the pool
# padded too, the products take a few shapes only (each new one costs a kernel build, as with pools).
ROW_STEP = 16


def row_chunks(rows: int, d: int) -> tuple[int, int]:
    """(rows per chunk, rows padded): chunks of a multiple of ``ROW_STEP`` rows, at most 2d when that
    allows (the logits then never outgrow twice the estimated keys; fewer, larger products run
    faster), as even as the multiple permits."""
    blocks = math.ceil(rows / ROW_STEP)
    per = math.ceil(blocks / math.ceil(blocks * ROW_STEP / max(2 * d, ROW_STEP))) * ROW_STEP
    return per, math.ceil(rows / per) * per


def _scaled_rows(q_win: torch.Tensor, hkv: int, dtype: torch.dtype, scaling: float) -> tuple[torch.Tensor, int, int]:
    """The window rows grouped by KV head, scaled and padded for the pool's products: (q (Hkv, rows
    padded, d) in ``dtype``, rows, rows per chunk)."""
    hq, w, d = q_win.shape
    rows = (hq // hkv) * w
    step, padded = row_chunks(rows, d)
    q = torch.zeros(hkv, padded, d, dtype=dtype, device=q_win.device)
    q[:, :rows] = q_win.reshape(hkv, rows, d).float() * scaling
    return q, rows, step


def pool_logits(q_win: torch.Tensor, sketch: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """The window rows' logits over a pool's sketched keys (Hkv, rows padded, N * P), when they take
    one product (the rows fit one chunk, as ``page_picks`` would make them); else None. They need no
    normaliser, so they can be made beside the attention over the device that gives it."""
    q, _, step = _scaled_rows(q_win, sketch.shape[0], sketch.dtype, scaling)
    return torch.bmm(q, sketch.transpose(1, 2)) if step >= q.shape[1] else None


@dataclass
class PoolScores:
    """What Stage 1 over a pool's sketched tokens says of its N pages per KV head.

    ranks (Hkv, N) float32: the number of the page's tokens the choice keeps, plus a fraction < 1 that
    orders the rest by their window mass. mass (Hkv, N) float32: the window mass of the page's alive
    sketched tokens (each row's softmax over the device and the pool, summed over the rows): which of
    the pages a turn does not read weigh most in its window rows' attention (``rocketkv_mt.standin``)."""

    ranks: torch.Tensor
    mass: torch.Tensor


def page_picks(
    q_win: torch.Tensor, window: Part, sketch: torch.Tensor, sketch_pos: torch.Tensor, sketch_alive: torch.Tensor,
    device_pos: torch.Tensor, history_len: int, prompt_budget: int, kernel_size: int, scaling: float,
    page_tokens: int, *, logits: torch.Tensor | None = None, backend: str = "auto",
) -> PoolScores:
    """Stage 1's choice over the device and the sketched cold tokens, page by page (``PoolScores``).

    q_win (Hq, w, d); ``window``: the window rows' part over the T device keys, positions device_pos
    (Hkv, T); sketch (Hkv, N * P, d) the estimated cold keys, page by page (float32, or the cheaper
    ``sketch_dtype``), with their positions and alive flags (Hkv, N * P). The cold tokens are history,
    so every window query sees them. In bfloat16 a logit is off by 2**-9 of its size: the logits
    that carry mass sit near the device's normaliser, and a sketch's own error is larger. ``logits``:
    ``pool_logits`` of the same rows and sketch, made ahead (None: made here)."""
    hq, w, d = q_win.shape
    hkv, m = sketch.shape[:2]
    pages = m // page_tokens
    if pages == 0:
        empty = torch.zeros(hkv, 0, dtype=torch.float32, device=sketch.device)
        return PoolScores(empty, empty.clone())
    if logits is None:
        q, rows, step = _scaled_rows(q_win, hkv, sketch.dtype, scaling)
    else:
        q, rows, step = None, (hq // hkv) * w, logits.shape[1]
    lse_dev = window.lse.reshape(hkv, -1)
    lse = torch.empty_like(lse_dev)  # each row's normaliser over the device and the pool
    cold = torch.zeros(hkv, m, dtype=torch.float32, device=sketch.device)
    keys_t = sketch.transpose(1, 2)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if q is not None:
            logits = torch.bmm(q[:, start : start + step], keys_t)  # (Hkv, step, N * P): rows past ``rows`` pad
        lse[:, start:stop] = dispatch.pool_mass(logits[:, : stop - start], sketch_alive, lse_dev[:, start:stop], cold,
                                                backend=backend)
    probs = torch.cat([window_probs(window, lse.reshape(hq, w)), cold], dim=1)
    slots = dispatch.choose_over_parts(probs, device_pos, sketch_pos, sketch_alive, history_len, w, prompt_budget,
                                       kernel_size, backend=backend)[0]
    t = device_pos.shape[1]
    from_cold = slots >= t
    page = torch.where(from_cold, (slots - t) // page_tokens, pages)
    picks = torch.zeros(hkv, pages + 1, dtype=torch.float32, device=slots.device)
    picks.scatter_add_(1, page, from_cold.float())
    mass = cold.view(hkv, pages, page_tokens).sum(dim=-1)
    return PoolScores(picks[:, :pages] + 0.5 * mass / mass.amax(dim=1, keepdim=True).clamp_min(1e-30), mass)
