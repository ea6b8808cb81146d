"""The attention function this project registers with transformers' attention registry.

Models run with ``attn_implementation="rocketkv"`` and receive the session cache as the
``rkv_cache`` forward keyword; transformers passes it through to every attention layer. Masks are
not built by transformers for this name: the cache knows the causal structure itself.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface

ATTENTION_NAME = "rocketkv"


def rocketkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, Hq, n, d), key/value (1, Hkv, n, d) of the new tokens -> ((1, n, Hq, d), None)."""
    cache = kwargs.get("rkv_cache")
    if cache is None:
        raise RuntimeError("the 'rocketkv' attention needs the session cache as the `rkv_cache` forward argument")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # Marks the layer's attention in a torch profile (``bench ops`` counts the ops inside it).
    with torch.profiler.record_function("rkv::attention"):
        return cache.attend(module.layer_idx, query, key, value, scaling), None


def register_attention() -> str:
    """Register the function under ``ATTENTION_NAME`` (idempotent) and return the name."""
    AttentionInterface.register(ATTENTION_NAME, rocketkv_attention)
    return ATTENTION_NAME
