"""Drive a session cache the way the model runner does, with random queries, keys and values instead
of a model: a small attention shape, fast on a CPU."""
from __future__ import annotations

import torch

from rocketkv_mt.cache import CacheSpec, TierContext, TierPolicy
from tiers.host.tier import HostTier

SPEC = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"),
                 kernels="torch")
HQ = 4
SCALING = SPEC.head_dim ** -0.5


def tier_context(policy: TierPolicy | None = None, session_id: str = "s", transfers=None) -> TierContext:
    """A host tier of its own (no Redis), large enough that nothing spills; ``transfers``: a page reader."""
    return TierContext(host=HostTier(64 << 20, None), session_id=session_id, policy=policy or TierPolicy(page_tokens=8),
                       transfers=transfers)


def random_qkv(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (1, HQ, n, d), k and v (1, Hkv, n, d)."""
    d, hkv = SPEC.head_dim, SPEC.num_kv_heads
    return (torch.randn(1, HQ, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen),
            torch.randn(1, hkv, n, d, generator=gen))


def forward(cache, inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, prefill: bool, max_new: int = 0,
            on_layer=None, rest: int = 0) -> list[torch.Tensor]:
    """One model forward: per layer, ``inputs[layer]``'s new tokens attend; ``on_layer(cache)`` after each
    layer (``rest``: tokens of the same prefill that later forwards feed). Returns each layer's output
    (1, n, HQ, d)."""
    cache.begin_forward(inputs[0][0].shape[2], prefill=prefill, max_new=max_new, rest=rest)
    outs = []
    for layer, (q, k, v) in enumerate(inputs):
        outs.append(cache.attend(layer, q, k, v, SCALING))
        if on_layer is not None:
            on_layer(cache)
    cache.end_forward()
    return outs


def forward_layered(cache, inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, max_new: int = 0,
                    rows: int = 32, on_group=None) -> list[torch.Tensor]:
    """A prompt fed layer by layer, as ``app.engine.layer_prefill`` feeds it: each layer's rows in
    groups of ``rows``, ``on_group(cache)`` after each; a later turn's layer takes the turn's keys and
    values first, in groups, then its window rows. Returns each layer's output (1, n, HQ, d)."""
    n = inputs[0][0].shape[2]
    later = cache.history_len > 0
    cache.begin_layered(n, max_new)
    outs = []
    for layer, (q, k, v) in enumerate(inputs):
        if later:
            for a in range(0, n, rows):
                cache.layered_keys(layer, k[0, :, a:a + rows], v[0, :, a:a + rows])
            cache.layered_window(layer, q[0, :, n - cache.layered_window_rows():], SCALING)
        parts = []
        for a in range(0, n, rows):
            b = min(n, a + rows)
            parts.append(cache.attend(layer, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], SCALING))
            if on_group is not None:
                on_group(cache)
        outs.append(torch.cat(parts, dim=1))
    cache.end_layered()
    return outs


def layer_inputs(gen: torch.Generator, n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [random_qkv(gen, n) for _ in range(SPEC.num_layers)]


@torch.inference_mode()  # as the model runner steps: what a page reader makes is an inference tensor
def three_turns(cache, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three turns (a long first one, two short ones with decode steps): every layer's outputs; after
    every turn each layer's kept positions and the cold token count."""
    gen = torch.Generator().manual_seed(seed)
    outs, kept = [], []
    for n_new, max_new in ((200, 4), (12, 4), (9, 3)):
        outs += forward(cache, layer_inputs(gen, n_new), prefill=True, max_new=max_new)
        for _ in range(max_new):
            outs += forward(cache, layer_inputs(gen, 1), prefill=False)
        cache.end_turn()
        kept += [store.positions.clone() for store in cache.layers]
        kept.append(torch.tensor([cache.cold_tokens()]))
    return outs, kept
