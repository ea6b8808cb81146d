"""The GPU check rehearsed as a lent GPU machine runs it: no registry, the image's packages, the
bundle installed with ``--no-index --target``, the check run from a copy of the tree that travels.

How close this comes to the lent machine, and where it cannot:
- The interpreter runs with ``-S``: no site-packages of its own, nothing from ``.venv``. What it can
  import is the standard library, the bundle's install folder, and a folder that stands in for the
  image (``bench.gpu_bundle.rehearsal``): links to this environment's copies of the packages on
  the image's list only (ray, fastapi, uvicorn, websockets, gguf, pydantic and redis are not on it),
  with the image's own versions of huggingface-hub, tokenizers, safetensors and accelerate.
- The image's Python is 3.12 with a CUDA torch; this machine's torch is a CPU build for 3.11. So the
  interpreter is this environment's base 3.11, torch and numpy are this environment's, and each
  binary wheel of the bundle (pydantic-core, regex: cp312 there) is installed here as its cp311
  twin of the same version; the pure wheels are the bundle's own files.
- pip comes from this environment (the image's own pip does the install there); it reads only the
  wheel folder (``--no-index``).
Building the bundle downloads from PyPI (as ``make gpu-bundle`` does); the run itself does not.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_bundle, gpu_check

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("ray", "fastapi", "uvicorn", "websockets", "gguf", "starlette")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """(bundle as built for the GPU, rehearsal folder) built from PyPI into a temporary folder."""
    base = tmp_path_factory.mktemp("gpu")
    try:
        gpu_bundle.build(base / ".gpu")
        gpu_bundle.rehearsal(base / ".gpu", base / "rehearse")
    except SystemExit as exc:  # pip could not reach PyPI: nothing here can make the bundle
        pytest.skip(f"the bundle could not be built here: {exc}")
    return base / ".gpu", base / "rehearse"


def _tree(dest: Path) -> Path:
    """A copy of what the device tool sends: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _rehearsal_bundle(bundle: Path, rehearse: Path, dest: Path) -> Path:
    """The bundle as this machine's Python takes it: its pure wheels, the cp311 twins of its binary ones."""
    shutil.copytree(bundle, dest)
    for wheel in (dest / "wheels").glob("*.whl"):
        if not wheel.name.endswith("-none-any.whl"):
            wheel.unlink()
    for twin in (rehearse / "twins").glob("*.whl"):
        shutil.copy2(twin, dest / "wheels")
    return dest


def _run(tree: Path, bundle: Path, rehearse: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp)),
        "RKV_CACHE_DIR": os.environ.get("RKV_CACHE_DIR", str(Path.home() / ".cache" / "rocketkv-mt")),
        "RKV_GPU_BUNDLE": str(bundle), "RKV_GPU_PYTHON": f"{sys._base_executable} -S",
        "RKV_GPU_PIP": f"{sys.executable} -m pip", "RKV_GPU_SITE": str(tmp / "site"),
        "PYTHONPATH": str(rehearse / "image"), "OUT": str(tmp / "out"),
        # Nothing answers here: the check starts the bundle's valkey-server for its Redis part.
        "RKV_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    return subprocess.run(["bash", "bench/gpu_run.sh", *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_check_runs_where_only_the_image_and_the_bundle_are(bundle, tmp_path):
    gpu, rehearse = bundle
    tree = _tree(tmp_path / "tree")
    wheels = _rehearsal_bundle(gpu, rehearse, tmp_path / "bundle")
    proc = _run(tree, wheels, rehearse, tmp_path, "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert not [p for p in summary["parts"].values() if "error" in p], summary
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back
    redis_part = json.loads((out / "tiered_redis.json").read_text())
    assert redis_part["redis"] == "private" and redis_part["redis_session_bytes_after_turn_3"] > 0
    assert redis_part["turns"][1]["prefilled_tokens"] < redis_part["turns"][0]["prefilled_tokens"]
    assert "speedups" in json.loads((out / "e2e.json").read_text())
    # The rehearsed environment is as bare as the image: none of the serving stack, the bundle's transformers.
    python = [sys._base_executable, "-S", "-c"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path / 'site'}:{rehearse / 'image'}"}
    for name in FORBIDDEN:
        probe = subprocess.run([*python, f"import {name}"], env=env, cwd=tree, capture_output=True, text=True)
        assert probe.returncode != 0 and "No module named" in probe.stderr, name
    version = subprocess.run([*python, "import transformers; print(transformers.__version__)"], env=env, cwd=tree,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == __import__("transformers").__version__
    # The kernel tests, which run only on CUDA there, at least collect in such an environment.
    collect = subprocess.run([sys._base_executable, "-S", "-m", "pytest", "--collect-only", "-q", "-p",
                              "no:cacheprovider", "-m", "kernel", *gpu_check.KERNEL_TESTS], env=env, cwd=tree,
                             capture_output=True, text=True, timeout=300)
    assert collect.returncode == 0 and " collected" in collect.stdout, collect.stdout[-2000:] + collect.stderr[-2000:]


def test_a_wheel_missing_from_the_bundle_is_named(bundle, tmp_path):
    gpu, rehearse = bundle
    tree = _tree(tmp_path / "tree")
    wheels = _rehearsal_bundle(gpu, rehearse, tmp_path / "bundle")
    next((wheels / "wheels").glob("redis-*.whl")).unlink()
    proc = _run(tree, wheels, rehearse, tmp_path, "--quick")
    assert proc.returncode == 3 and "lacks the wheel of redis" in proc.stderr, proc.stderr
    # Dropped from the manifest too, the environment itself lacks it: the import names the package.
    lines = (wheels / "wheels.txt").read_text().splitlines()
    (wheels / "wheels.txt").write_text("\n".join(line for line in lines if not line.startswith("redis ")) + "\n")
    proc = _run(tree, wheels, rehearse, tmp_path, "--quick")
    assert proc.returncode == 5 and "No module named 'redis'" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_tree_and_bundle_travel_within_the_limit(bundle):
    gpu, _ = bundle
    total = gpu_bundle.tree_bytes() + gpu_bundle.folder_bytes(gpu)
    assert total <= gpu_bundle.LIMIT_MIB * 2**20, f"{total / 2**20:.1f} MiB would travel"
    run = json.loads((gpu / "run.txt").read_text())
    assert run["carry"] == [".gpu"] and run["command"] == "bash bench/gpu_run.sh" and run["timeout_s"] <= 600


def test_the_check_imports_none_of_the_serving_stack():
    """In the full environment, where they are installed: the check's modules never import them."""
    code = ("import sys, bench.gpu_check, bench.random_model, bench.byte_tokenizer; "
            f"print([m for m in {FORBIDDEN!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout
