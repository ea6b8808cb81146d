"""The bundled GGUF is dequantized once; later loads in new processes read the safetensors cache."""
import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

LOAD = r"""
import json, sys
import transformers.modeling_gguf_pytorch_utils as gguf_utils
calls = []
real = gguf_utils.load_gguf_checkpoint
def counting(*a, **k):
    calls.append(1)
    return real(*a, **k)
gguf_utils.load_gguf_checkpoint = counting
from app.settings import Settings
from app.model_loader import load_model
loaded = load_model(Settings(cache_dir=sys.argv[1]))
print(json.dumps({"source": loaded.source, "gguf_reads": len(calls), "path": str(loaded.path)}))
"""


def run_load(cache_dir) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(cache_dir)], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def test_second_load_reads_safetensors_cache(tmp_path):
    first = run_load(tmp_path)
    assert first["source"] == "gguf" and first["gguf_reads"] > 0
    # Its stderr is a pipe, not a terminal: the conversion's progress bar wrote nothing there.
    assert not re.search(r"converting \S+\.gguf \(once\)", first["stderr"])
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "models").rglob("*"))
    second = run_load(tmp_path)
    assert second["source"] == "safetensors-cache"
    assert second["gguf_reads"] == 0
    assert second["path"] == first["path"]
