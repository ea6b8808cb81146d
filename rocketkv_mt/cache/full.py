"""``full``: dense KV of the whole conversation, no compression."""
from __future__ import annotations

import torch

from rocketkv_mt.cache.base import SessionCache


class FullCache(SessionCache):
    mode = "full"

    def after_prefill(self, layer: int, q: torch.Tensor, scaling: float) -> None:
        return None
