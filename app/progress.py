"""Progress bars of long work (``eval``, the benchmarks, a model's first conversion): ``tqdm`` on stderr,
the running figure (accuracy, throughput) beside the count.

Shown only to a person watching: where stderr is not a terminal (a pipe, a log file, CI) or with
``--quiet`` a bar writes nothing at all, so logs and JSON on stdout stay as they were.
"""
from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def shown(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """Whether a bar on ``stream`` (default stderr) is drawn: a terminal, and not ``quiet``."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and isatty is not None and bool(isatty())


def progress(total: int | None, desc: str, *, quiet: bool = False, unit: str = "it",
             stream: TextIO | None = None) -> tqdm:
    """A bar of ``total`` steps (None: a bare count) on ``stream`` (default stderr); disabled, writing
    nothing, unless ``shown``. Use it as a context manager; ``set_postfix`` carries the running figure."""
    stream = sys.stderr if stream is None else stream
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not shown(quiet, stream),
                dynamic_ncols=True, leave=True)
