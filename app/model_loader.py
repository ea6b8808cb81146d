"""Model loading: a bundled GGUF (converted once to a safetensors cache), a hub id or a local path.

The bundled models and where their GGUF files are live in ``app.model_registry``.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from app import cpu_linear
from app.model_registry import ModelNotFound as ModelNotFound  # still importable from here, where it was
from app.model_registry import bundled_model
from app.progress import progress
from app.settings import Settings
from rocketkv_mt.attention import register_attention

log = logging.getLogger(__name__)
CACHE_MARKER = "rocketkv-mt-converted"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str  # "safetensors-cache", "gguf" (converted now) or "pretrained"
    path: Path | str
    device: torch.device
    dtype: torch.dtype


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def _gguf_source(settings: Settings) -> tuple[Path, str] | None:
    """(folder, file name) when the configured model is a GGUF file, else None."""
    bundled = bundled_model(settings.model)
    if bundled is not None:
        path = bundled.gguf_path(settings.cache_dir)
        return path.parent, path.name
    if settings.gguf_file:
        return Path(settings.model), settings.gguf_file
    if settings.model.endswith(".gguf") and Path(settings.model).is_file():
        path = Path(settings.model)
        return path.parent, path.name
    return None


def converted_dir(settings: Settings, gguf_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", gguf_name.removesuffix(".gguf"))
    return settings.cache_dir / "models" / slug


def _convert_gguf(folder: Path, name: str, target: Path, quiet: bool = False) -> None:
    """Dequantize the GGUF once and write model + tokenizer as safetensors under ``target`` (a bar of
    its three steps on a terminal, unless ``quiet``: the dequantization takes a while)."""
    log.info("converting %s to a safetensors cache at %s (once)", name, target)
    with progress(3, f"converting {name} (once)", quiet=quiet, unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
        bar.update()
        bar.set_postfix_str("dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("writing safetensors")
        _write_converted(model, tokenizer, name, target)
        bar.update()


def _write_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, target: Path) -> None:
    """Save a converted model and its tokenizer as ``target`` (whole, or not at all)."""
    # The weights are plain tensors now; a saved GGUF quantization entry would send later loads back to the GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / CACHE_MARKER).write_text(name + "\n")
        # Another process may have finished first; either copy is complete and identical.
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / CACHE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(settings: Settings, quiet: bool = False) -> LoadedModel:
    """Load the configured model for inference with the ``rocketkv`` attention registered (``quiet``: no
    progress bar, should it be converted now)."""
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    if settings.threads and device.type == "cpu":
        torch.set_num_threads(settings.threads)
    source, path = "pretrained", settings.model
    gguf = _gguf_source(settings)
    if gguf is not None:
        folder, name = gguf
        path = converted_dir(settings, name)
        source = "safetensors-cache"
        if not (path / CACHE_MARKER).exists():
            _convert_gguf(folder, name, path, quiet)
            source = "gguf"
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.to(device).eval()
    if settings.cpu_linear == "onednn" and cpu_linear.available(device, dtype):
        try:
            cpu_linear.pack_linears(model)
        except RuntimeError as exc:  # a oneDNN build that cannot pack here: the model keeps nn.Linear
            log.warning("oneDNN could not pack the linear layers (%s): using nn.Linear", exc)
    model.set_attn_implementation(register_attention())
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, path=path, device=device, dtype=dtype)
