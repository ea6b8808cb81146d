"""Exact attention over key sets that arrive in parts, merged by log-sum-exp, with the window's scores.

A tiered turn attends over the keys on the device first and over the cold pages it reads back
second; which pages to read depends on the first part's normaliser. Each part is computed on its
own (fp32 softmax, the turn's own tokens causal) and the parts are merged exactly:
out = Σ_p out_p · exp(lse_p − lse), lse = logsumexp_p lse_p. The last ``w`` query rows are Stage 1's
observation window; their logits are kept (as exponentials, so scoring them is one product, not a
new exp), so the window scores of every slot come out of the same pass on the CPU; on CUDA the rows
stream through a flash-style kernel and only the window rows are scored in full, beside it.

Shapes: Hq query heads, Hkv KV heads, g = Hq / Hkv, n queries (the turn's tokens), T keys of a part,
w window rows, d head dim. Query head h*g + j reads KV head h.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocketkv_mt import dispatch

# Query rows per pass: bounds the (rows x keys) fp32 logits of a long turn.
ROWS = 1024


@dataclass
class Part:
    out: torch.Tensor  # (Hq, n, d) fp32, normalised over this part's keys (0 where it has none)
    lse: torch.Tensor  # (Hq, n) fp32 log-sum-exp of this part's logits (-inf where it has none)
    window_probs: torch.Tensor | None  # (Hkv, g, w, T) fp32 exp(logit - window_top) of the window rows (0 where hidden)
    window_top: torch.Tensor | None  # (Hkv, g, w, 1) fp32 the shift of those rows (None: no window rows here)


def attend_part(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, w: int,
    own_tail: int = 0, visible: torch.Tensor | None = None, first_row: int = 0, *, backend: str = "auto",
) -> Part:
    """Attention of q (Hq, n, d) over one part's keys/values (Hkv, T, d).

    The last ``own_tail`` keys are the turn's own tokens and q holds the turn's rows ``first_row``
    .. ``first_row + n - 1`` (all of them by default, own_tail == n): row i sees tail key k only for
    k <= i. Every other key is in every query's past. Slots where ``visible`` (Hkv, T) is False hold
    no token. The last ``w`` rows of q are window rows (w = 0: none). Where the Triton kernels run
    (CUDA), the rows stream through ``kernels.attend_rows`` (no (rows x keys) logits) and only the
    window rows are scored in full."""
    hq, n, d = q.shape
    t = keys.shape[1]
    if dispatch.uses_triton(backend, q):
        # Row i sits at position (T - own_tail) + first_row + i and key j at j: the tail is causal, the
        # rest seen by all.
        offset = t - own_tail + first_row if own_tail else t
        out, lse = dispatch.attend_rows(q, keys, values, scaling, q_offset=offset, alive=visible,
                                        out_dtype=torch.float32)
        if not w:
            return Part(out, lse, None, None)
        logits = _logits(q, keys, scaling, n - w, n, own_tail, visible, first_row, backend=backend)
        top = _row_top(logits)
        return Part(out, lse, torch.exp(logits - top), top)
    # Once for every block of rows (the same tensors where they are float32 already).
    keys, values = keys.float(), values.float()
    if n <= ROWS and dispatch.takes_part(q, keys, values, backend=backend):
        # The whole part in one native call: the torch ops below cost more to dispatch than to run.
        return Part(*dispatch.whole_part(q, keys, values, scaling, w, own_tail, visible, first_row))
    out = torch.empty(hq, n, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(hq, n, dtype=torch.float32, device=q.device)
    window = None
    for start in range(0, n, ROWS):
        stop = min(n, start + ROWS)
        r = stop - start
        logits = _logits(q, keys, scaling, start, stop, own_tail, visible, first_row, backend=backend)
        hkv, g = logits.shape[:2]
        top, total = dispatch.softmax_rows(logits, backend=backend)  # in place: the logits are not needed again
        probs = logits
        o = dispatch.part_values(probs.view(hkv, g * r, t), values, backend=backend).view(hkv, g, r, d)
        o = o / total.clamp_min(1e-30)
        out[:, start:stop] = o.reshape(hq, r, d)
        lse[:, start:stop] = (top + torch.log(total)).reshape(hq, r)
        if w and stop > n - w:  # the window rows are the last w: keep their shifted exponentials
            first = max(start, n - w) - start
            rows = (probs[:, :, first:], top[:, :, first:])
            window = rows if window is None else tuple(torch.cat([a, b], dim=2) for a, b in zip(window, rows))
    return Part(out, lse, *(window or (None, None)))


def join_rows(first: Part, then: Part) -> Part:
    """One part from two computed over consecutive row ranges of the same keys (``then`` holds the
    window rows)."""
    return Part(torch.cat([first.out, then.out], dim=1), torch.cat([first.lse, then.lse], dim=1),
                then.window_probs, then.window_top)


def _logits(
    q: torch.Tensor, keys: torch.Tensor, scaling: float, start: int, stop: int, own_tail: int,
    visible: torch.Tensor | None, first_row: int = 0, *, backend: str = "auto",
) -> torch.Tensor:
    """fp32 logits (Hkv, g, rows, T) of q's rows start..stop (the turn's rows first_row + start ..)
    over keys (Hkv, T, d), hidden ones -inf."""
    hq, n, d = q.shape
    hkv, t, _ = keys.shape
    g, r = hq // hkv, stop - start
    logits = dispatch.part_logits(q[:, start:stop].reshape(hkv, g * r, d).float(), keys, scaling,
                                  backend=backend).view(hkv, g, r, t)
    # Hidden slots get -inf added, not filled in: on a CPU a broadcast masked_fill_ over the logits
    # costs about ten times an add of a small bias (measured here: 353 against 36 us over 3 x 3 x 21 x
    # 1216 logits), and x + (-inf) is -inf, x + 0 is x, so the logits are the same.
    if own_tail:
        rows = torch.arange(first_row + start, first_row + stop, device=q.device).view(-1, 1)
        causal = torch.arange(own_tail, device=q.device).view(1, -1) > rows
        logits[..., t - own_tail :].add_(_hidden(causal))
    if visible is not None:
        logits.add_(_hidden(~visible).view(hkv, 1, 1, t))
    return logits


def _hidden(mask: torch.Tensor) -> torch.Tensor:
    """-inf where ``mask`` is set, 0 elsewhere (float32)."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(mask, float("-inf"))


def _row_top(logits: torch.Tensor) -> torch.Tensor:
    """Each row's max logit (..., 1), 0 for a row that sees nothing (so exp(-inf - 0) is 0, not NaN)."""
    top = logits.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(top), top, torch.zeros_like(top))


def merge(parts: list[Part], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (Hq, n, d) in ``dtype``, lse (Hq, n)) over the union of the parts' keys."""
    lse = torch.logsumexp(torch.stack([p.lse for p in parts]), dim=0)
    out = sum(p.out * torch.exp(p.lse - lse).unsqueeze(-1) for p in parts)
    return out.to(dtype), lse


def window_probs(part: Part, lse: torch.Tensor) -> torch.Tensor:
    """Stage 1's score of each of the part's slots: its softmax mass summed over the window rows and
    the group's query heads, (Hkv, T). ``lse`` (Hq, n) is the merged one."""
    hkv, g, w, _ = part.window_probs.shape
    scale = torch.exp(part.window_top - lse[:, -w:].reshape(hkv, g, w, 1))
    return torch.matmul(scale.reshape(hkv, 1, g * w), part.window_probs.reshape(hkv, g * w, -1)).squeeze(1)
