"""Runs the transformers model over session caches: ``forward`` feeds one session, ``step`` feeds
several in one forward (their tokens packed into one sequence, see ``rocketkv_mt.cache.batch``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.layer_prefill import LAYERED_MODEL_TYPES
from app.model_loader import LoadedModel
from rocketkv_mt.cache import CacheSpec, SessionCache
from rocketkv_mt.cache.batch import BatchCache


@dataclass
class Segment:
    """What one session feeds in a batched step."""

    cache: SessionCache
    ids: list[int]
    prefill: bool = False
    max_new: int = 0
    rest: int = 0  # tokens of the same prefill that later steps feed (a prefill split into chunks)


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
        # A first prompt may be fed layer by layer (``app.engine.layer_prefill``) on these layouts only.
        self.layerable = getattr(cfg, "model_type", None) in LAYERED_MODEL_TYPES
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

    @torch.inference_mode()
    def step(self, segments: list[Segment]) -> tuple[torch.Tensor, dict[int, BaseException]]:
        """One forward for several sessions: segment i feeds ``segments[i].ids`` on top of its cache
        (a turn's prefill, or one decode token), packed into one sequence (``BatchCache``).

        Returns the logits of each segment's last token (S, V) in float32, and the segments whose
        cache failed ({index: exception}): those caches are left mid-step (discard them), the others
        have advanced. An exception outside the caches (in the model itself) propagates and leaves
        every cache of the step mid-step.
        """
        errors: dict[int, BaseException] = {}
        ok = []
        for i, s in enumerate(segments):
            try:
                s.cache.begin_forward(len(s.ids), prefill=s.prefill, max_new=s.max_new, rest=s.rest)
                ok.append(i)
            except Exception as exc:  # noqa: BLE001 - that session fails alone
                errors[i] = exc
        if not ok:
            return torch.zeros(len(segments), self.model.config.vocab_size, device=self.device), errors
        batch = BatchCache([segments[i].cache for i in ok], [len(segments[i].ids) for i in ok])
        ids = [t for i in ok for t in segments[i].ids]
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
            position_ids=batch.positions(),
            rkv_cache=batch,
            use_cache=False,
            logits_to_keep=batch.last_indices(self.device),
        )
        for j, i in enumerate(ok):
            if j in batch.errors:
                errors[i] = batch.errors[j]
            else:
                segments[i].cache.end_forward()
        rows = out.logits[0].float()
        if len(ok) == len(segments):
            return rows, errors
        logits = rows.new_zeros(len(segments), rows.shape[-1])
        logits[ok] = rows
        return logits, errors
