"""A Llama-architecture model built from a config with random weights, for benchmarks that need a
model's shapes and costs, not its answers (``bench e2e``, ``bench ops``).

The default shapes are Llama-3.1-8B's: 32 layers, 32 query heads over 8 KV heads, head dim 128,
hidden 4096, MLP 14336, vocabulary 128256. Weights are drawn on the target device in the target
dtype (no checkpoint, no tokenizer), with the ``rocketkv`` attention registered like a loaded model.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from app.model_loader import LoadedModel
from bench.byte_tokenizer import byte_tokenizer
from rocketkv_mt.attention import register_attention

LLAMA_31_8B = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}
# A few layers of a small model: the CPU tests' shapes.
TINY = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 256,
}
# The bundled SmolLM2-135M's attention shapes (30 layers, 9 query heads over 3 KV heads, head dim 64):
# its tiered costs, without its weights or its 49k vocabulary.
SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}


def random_model(shapes: dict, device: torch.device | str, dtype: torch.dtype, max_positions: int, seed: int = 0,
                 **config) -> LoadedModel:
    """A random-weight Llama of ``shapes`` (``LlamaConfig`` fields, ``config`` adds others) on ``device``
    in ``dtype``, with rotary tables for ``max_positions`` positions."""
    device = torch.device(device)
    config = LlamaConfig(**shapes, **config, max_position_embeddings=max_positions, rope_theta=500_000.0)
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.set_attn_implementation(register_attention())
    return LoadedModel(model=model, tokenizer=None, source="random", path="", device=device, dtype=dtype)


def random_chat_model(shapes: dict, device: torch.device | str, dtype: torch.dtype, max_positions: int,
                      seed: int = 0) -> LoadedModel:
    """``random_model`` with the in-memory byte tokenizer (``bench.byte_tokenizer``) and a vocabulary of
    its size, so the engine can hold a conversation with it: its replies are noise, its costs real."""
    tokenizer = byte_tokenizer()
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    loaded = random_model({**shapes, "vocab_size": len(tokenizer)}, device, dtype, max_positions, seed, **ids)
    loaded.model.generation_config.eos_token_id = tokenizer.eos_token_id
    loaded.tokenizer, loaded.source = tokenizer, "random-chat"
    return loaded


def parse_shapes(text: str) -> dict:
    """``"llama-3.1-8b"``, ``"smollm2-135m"``, ``"tiny"`` or ``key=value,...`` over one of them (e.g. ``tiny,num_hidden_layers=3``)."""
    base, *overrides = [part.strip() for part in text.split(",") if part.strip()]
    named = {"llama-3.1-8b": LLAMA_31_8B, "smollm2-135m": SMOLLM2_135M, "tiny": TINY}
    if base not in named:
        raise ValueError(f"unknown model shapes {base!r}; one of {sorted(named)}, then key=value overrides")
    shapes = dict(named[base])
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in shapes:
            raise ValueError(f"unknown shape field {key!r}; one of {sorted(shapes)}")
        shapes[key] = int(value)
    return shapes
