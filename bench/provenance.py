"""Where a result came from: the command that made it, the machine it ran on, the commit of the code.

Every result file carries these three fields (``write_json`` adds them), so a figure can be traced and
compared with another only where the machine is the same; ``bench report`` prints them with each table.
Standard library only: the GPU check writes results on a lent machine with none of the project's
dependencies and possibly no git.
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Settings that change what a bench measures travel in the environment; the command shows them.
ENV_PREFIX = "RKV_"
# The commit of a tree that travelled without its git history (a lent GPU machine): gpu_run.sh sets it
# from the bundle, which `make gpu-bundle` builds in the checkout.
SOURCE_COMMIT = "RKV_SOURCE_COMMIT"
# The test suite's own switches (which Redis, whether it must be up) say nothing about a benchmark.
TEST_PREFIX = "RKV_TEST_"


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``platform.processor()`` where there is no /proc)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first CUDA device's name, when torch is already loaded and sees one (no import just for this)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a broken driver must not cost the result it is stamping
        return None
    return None


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu_name()}


def commit(root: Path = ROOT) -> str | None:
    """The short hash of the checked-out commit, with ``-dirty`` when tracked files differ from it.
    Outside a git checkout (a lent machine receives the tree without its history): ``RKV_SOURCE_COMMIT``,
    else None."""
    travelled = os.environ.get(SOURCE_COMMIT) or None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return travelled
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=30).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return travelled
    return head.stdout.strip() + ("-dirty" if dirty else "")


def command(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> str:
    """The command line as a user would type it again: the ``RKV_`` settings in force, then
    ``rocketkv-mt ...`` (or ``python -m bench.x ...`` for a bench run as a module)."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    program = Path(argv[0]) if argv else Path("python")
    if program.name == "rocketkv-mt" or program.parent.name == "cli":
        head = "rocketkv-mt"
    elif program.suffix == ".py" and program.parent.name == "bench":
        head = f"python -m bench.{program.stem}"
    else:
        head = program.name
    settings = [f"{k}={shlex.quote(v)}" for k, v in sorted(environ.items())
                if k.startswith(ENV_PREFIX) and k != SOURCE_COMMIT and not k.startswith(TEST_PREFIX)]
    return " ".join([*settings, head, *(shlex.quote(a) for a in argv[1:])])


def stamp(result: dict) -> dict:
    """``result`` with ``command``, ``machine`` and ``commit`` first; fields it already has are kept."""
    return {"command": command(), "machine": machine(), "commit": commit(), **result}
