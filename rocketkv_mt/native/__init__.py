"""Native CPU kernels: plain C compiled on first use with the machine's C compiler, called through ctypes.

On a CPU, HSA's decode step is about forty tiny torch ops whose dispatch costs several times their
arithmetic; ``hsa_decode.c`` does the same computation in one call, and one layer's decode step of
every decoding session (appends, KT, HSA or dense attention) in another. ``pool_mass.c`` sums the
window mass of a tiered turn's sketched cold tokens in one pass per row of their logits,
``stage1_choose.c`` makes Stage 1's choice over slots in any order (twice a layer in a tiered turn),
``softmax_rows.c`` takes the exponentials of a tiered turn's attention parts, and ``attend_rows.c``
the causal attention of a prefill chunk's few rows over the history, and the two products of such a
part; ``kt_bounds.c`` builds a layer's KT page bounds when a cache selects.
The shared library is built for this machine (``-march=native``) into the cache directory, under a
name that hashes the sources, the flags and the CPU, so a copy built on another machine is never
loaded. Where no compiler is found the loader returns None and callers keep the torch paths
(``rocketkv_mt.dispatch``).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("hsa_decode.c", "pool_mass.c", "stage1_choose.c",
                                                             "softmax_rows.c", "attend_rows.c", "kt_bounds.c"))
# Fast math at compile time only (it vectorises expf): linking with it would switch the whole process
# to flush-to-zero on some toolchains. The kernel never relies on inf or NaN.
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffast-math")


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return platform.machine() + flags


def _cache_dir() -> Path:
    root = os.environ.get("RKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rocketkv-mt")
    return Path(root) / "native"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private directory and renamed into place: replicas starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        for source, obj in zip(SOURCES, objs):
            subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)], check=True, capture_output=True)
        lib = Path(tmp) / target.name
        subprocess.run([compiler, "-shared", *map(str, objs), "-o", str(lib), "-lm"], check=True, capture_output=True)
        os.replace(lib, target)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built if needed; None when it cannot be built here (logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler found: HSA decode, pool mass and Stage 1's choice use the torch paths on CPU")
        return None
    text = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(text + repr(COMPILE_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"rkv_hsa_{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("native kernels unavailable (%s %s): using the torch paths", exc, detail.decode(errors="replace")[:500])
        return None
    fn = lib.rkv_hsa_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 13 + [ctypes.c_float]
    fn = lib.rkv_decode_batch
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_float]
    fn = lib.rkv_pool_mass
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [
        ctypes.c_float] * 2
    fn = lib.rkv_choose
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 4
    fn = lib.rkv_softmax_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn = lib.rkv_attend_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [
        ctypes.c_float, ctypes.c_void_p]
    fn = lib.rkv_row_logits
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [
        ctypes.c_float, ctypes.c_void_p]
    fn = lib.rkv_page_bounds
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_void_p, ctypes.c_int64]
    fn = lib.rkv_attend_part
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [
        ctypes.c_float] + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5
    fn = lib.rkv_row_values
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [
        ctypes.c_void_p]
    return lib


def available() -> bool:
    return library() is not None
