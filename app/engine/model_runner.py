"""Runs the transformers model over a session cache: one forward per prefill or decode step."""
from __future__ import annotations

import torch

from app.model_loader import LoadedModel
from rocketkv_mt.cache import CacheSpec, SessionCache


class ModelRunner:
    """Owns the model; every forward goes through the registered ``rocketkv`` attention."""

    def __init__(self, loaded: LoadedModel, kernels: str = "auto"):
        self.model = loaded.model
        self.device = loaded.device
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.spec = CacheSpec(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            dtype=loaded.dtype,
            device=loaded.device,
            kernels=kernels,
        )
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 4096))
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: SessionCache, *, prefill: bool, max_new: int = 0) -> torch.Tensor:
        """Feed ``ids`` on top of the cache; returns the last position's logits (V,) in float32."""
        n = len(ids)
        cache.begin_forward(n, prefill=prefill, max_new=max_new)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=cache.positions(n).unsqueeze(0),
            rkv_cache=cache,
            use_cache=False,
            logits_to_keep=1,
        )
        # Only a completed forward advances the cache; after a failure the engine rebuilds it.
        cache.end_forward()
        return out.logits[0, -1].float()
