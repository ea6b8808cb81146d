"""deploy/kuberay/rayservice.yaml: the application, settings and node layout of the compose cluster.

No Kubernetes here: the manifest is parsed, its Serve config's import path is imported and built
with its ``args`` (building needs no running Ray), and what it says is compared with what
docker-compose.yml and ``api.deployment`` say.
"""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")  # a compose variable with its default: ${RKV_MODE:-tiered}


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())


@pytest.fixture(scope="module")
def serve_config(manifest) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def compose_head_environment() -> dict[str, str]:
    """The compose head's RKV_ settings, each at its default."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = compose["services"]["ray-head"]["environment"]
    return {k: DEFAULT.sub(lambda m: m.group(2), str(v)) for k, v in env.items()}


def container(spec: dict) -> dict:
    (only,) = spec["template"]["spec"]["containers"]
    return only


def test_the_manifest_deploys_the_application_of_the_deployment_code(manifest, serve_config):
    from api import deployment

    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    (app,) = serve_config["applications"]
    assert app["name"] == deployment.APP_NAME and app["route_prefix"] == "/"
    module, name = app["import_path"].split(":")
    assert getattr(importlib.import_module(module), name) is deployment.app_builder
    assert serve_config["proxy_location"] == deployment.PROXY_LOCATION
    assert serve_config["http_options"]["port"] == 8000
    # Built as Serve builds it: the chat replicas ask for the `chat` slots, the ingress for the head.
    built = deployment.app_builder(app["args"])
    ingress = built._bound_deployment
    chat = ingress.init_args[0]._bound_deployment
    assert chat.ray_actor_options["resources"] == app["args"]["replica_resources"]
    assert deployment.HEAD_NODE_RESOURCE in ingress.ray_actor_options["resources"]
    assert chat.num_replicas == app["args"]["num_replicas"]


def test_the_manifest_says_what_compose_says(serve_config, monkeypatch):
    from app.settings import ServerSettings

    (app,) = serve_config["applications"]
    args = app["args"]
    assert set(args) <= set(ServerSettings.model_fields), sorted(set(args) - set(ServerSettings.model_fields))
    # The compose head's settings as its environment gives them, against the manifest's args.
    env = compose_head_environment()
    for name in args:
        monkeypatch.setenv(f"RKV_{name.upper()}", env[f"RKV_{name.upper()}"])
    assert ServerSettings().model_dump(include=set(args)) == ServerSettings(**args).model_dump(include=set(args))


def test_chat_replicas_fit_the_worker_group_and_never_the_head(manifest, serve_config):
    (app,) = serve_config["applications"]
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "resources" not in head["rayStartParams"]
    (group,) = cluster["workerGroupSpecs"]
    # KubeRay pastes the value into `ray start --resources=...`: a quoted JSON object.
    offered = json.loads(json.loads(group["rayStartParams"]["resources"]))
    for name, amount in app["args"]["replica_resources"].items():
        assert offered[name] >= amount
    assert float(group["rayStartParams"]["num-cpus"]) >= app["args"]["replica_num_cpus"]
    assert group["replicas"] >= app["args"]["num_replicas"] / min(offered.values())
    for spec in (head, group):
        pod = spec["template"]["spec"]
        # Ray's object store lives in /dev/shm: a memory volume, not the container's 64 MiB default.
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in container(spec)["volumeMounts"]
        assert container(spec)["image"] == "rocketkv-mt:latest"


def test_the_image_has_what_kuberay_probes_run():
    # KubeRay's probes (and those the manifest sets for workers) exec wget in every Ray container.
    assert re.search(r"apt-get install[^\n]*\bwget\b", (ROOT / "Dockerfile").read_text())
