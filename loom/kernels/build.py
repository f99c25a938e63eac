"""Compiling loom's C kernels: the cache directory, the CPU's flags and one compiler call per (kernel, ISA).

Each kernel's sources (`loom/kernels/csrc/`) are compiled with the system C compiler (`$CC`, else `cc`) as
`-O3 -fopenmp -shared` plus the ISA's flags into `<cache>/kernels/<name>-<isa>-<hash>.so`, where <cache> is
`$LOOM_CACHE_DIR` or `~/.cache/loom` and the hash covers the sources, every header, the compiler and the
flags; later processes load the cached library. Builds of the same kernel and ISA from other sources are deleted
once no process has used them for a week (another checkout on the machine may still load them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loom.env import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# no silent FMA contraction: roundings as written in the sources (kernels that want FMA call it explicitly)
BASE_CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off")


def cache_dir() -> Path:
    """`$LOOM_CACHE_DIR/kernels` or `~/.cache/loom/kernels` (created).

    Raises:
        OSError: the directory cannot be created, naming it and where its path came from.
    """
    path = cache_root() / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        origin = "LOOM_CACHE_DIR" if os.environ.get("LOOM_CACHE_DIR") else "the default cache directory"
        raise OSError(f"the kernel cache {path} ({origin}) cannot be created ({exc.strerror or exc}): every C "
                      "kernel is off; set LOOM_CACHE_DIR to a writable directory") from exc
    return path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo (Linux x86; empty elsewhere, where only portable builds run)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# builds of other sources of a kernel are deleted once unused this long: another checkout or virtual environment on
# the machine may still load them (deleting them at once made two checkouts recompile each other's kernels, ~25 s
# a start), but a cache must not grow with every source version either
PRUNE_UNUSED_S = 7 * 24 * 3600


def _prune(target: Path, stem: str) -> None:
    """Delete the builds of `target`'s kernel and ISA from other sources that no process has used (loaded or
    built) for PRUNE_UNUSED_S seconds."""
    cutoff = time.time() - PRUNE_UNUSED_S
    for old in target.parent.glob(f"{stem}-*.so"):
        with contextlib.suppress(OSError):
            if old != target and old.stat().st_mtime < cutoff:
                old.unlink()


def build_library(name: str, sources: Sequence[str], cflags: Sequence[str] = (), tag: str = "") -> Path:
    """Compile `csrc/<source>` for each source into one shared library in the cache; returns its path.

    `tag` (the ISA name) keeps the builds of one kernel for different ISAs apart. Built once per hash of the
    sources, headers, compiler and flags.

    Raises:
        RuntimeError: no C compiler found, or it failed (its stderr is in the message).
    """
    paths = [CSRC / s for s in sources]
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} not found (set $CC)")
    flags = [*BASE_CFLAGS, *cflags]
    blob = b"".join(p.read_bytes() for p in paths) + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    digest = hashlib.sha256(blob + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    stem = f"{name}-{tag}" if tag else name
    target = cache_dir() / f"{stem}-{digest}.so"
    if target.exists():
        with contextlib.suppress(OSError):  # its mtime says when it was last used (a read-only cache stays as is)
            os.utime(target)
        return target
    # a first run compiles every kernel it loads, ~25 s in all on 2 cores: say so rather than sit silent
    logger.info("compiling loom's C kernel %s (%s) into %s (once per source version)", name, tag or "default",
                target.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, *map(str, paths), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            detail = proc.stderr.strip()[-2000:] or "no error output"
            raise RuntimeError(f"{compiler} exited with {proc.returncode} on {', '.join(sources)}: {detail}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same source writes the same bytes
        _prune(target, stem)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
