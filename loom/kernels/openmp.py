"""The OpenMP runtime loom's kernels and torch's CPU ops share: handing back a thread's worker pool.

An OpenMP runtime keeps one pool of worker threads per thread that opens parallel regions. GNU libgomp counts
every pool's threads, and once that count exceeds the CPUs it shortens the spin of a waiting thread from ~300,000
iterations to ~100-1,000 ("throttled" spinning, libgomp's config/linux/wait.h): a thread that reaches a barrier
first then sleeps in the kernel almost at once, and its partner has to wake it. loom's decode step crosses ~150
barriers a step, so each one became a futex sleep and wake.

That happened in `loom serve`: the engine is built (weights repacked, kernels warmed up) on the main thread, whose
pool then stays alive, and stepped on the engine thread, which opens a second pool. On a 2-CPU machine with 2
threads that is 3 managed threads for 2 CPUs: the engine thread slept ~150 times a step (445,000 voluntary context
switches in a 2,900-step ShareGPT run; benchmarks/NOTES.md, "Serving: two OpenMP pools"). `release_thread_pool()`,
called on the thread that built the engine before the engine thread starts, hands that pool back, as the OpenMP 5.0
routine `omp_pause_resource_all` does for the calling thread (OpenMP 5.0 spec, section 3.2.44; libgomp frees the
caller's pool, LLVM's libomp its whole runtime, which restarts on the next parallel region).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

# Runtime libraries whose `omp_pause_resource_all` we call, by file name prefix
_RUNTIMES = ("libgomp", "libomp", "libiomp5")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state (the spec's value)


def loaded_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes this process has loaded, in address order (torch's libgomp, which loom's kernels
    resolve to, and any a wheel bundles: sentencepiece ships its own libgomp); [] where none is loaded or the
    platform is not Linux (read from /proc/self/maps)."""
    if not sys.platform.startswith("linux"):
        return []
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
                if len(fields) == 6:
                    path = fields[5].strip()
                    if os.path.basename(path).startswith(_RUNTIMES) and path not in paths:
                        paths.append(path)
    except OSError:
        return []
    return paths


_pause_functions: list[tuple[str, Any]] | None = None  # (runtime path, its omp_pause_resource_all), from the last scan


def release_thread_pool(rescan: bool = True) -> bool:
    """Hand back the calling thread's OpenMP worker threads in every loaded runtime
    (`omp_pause_resource_all(omp_pause_soft)` in each).

    Call it on a thread that will open no more parallel regions (they would start a new pool) once another thread
    takes over the parallel work. rescan: read /proc/self/maps again for runtimes loaded since the last call (~1 ms);
    False reuses the last scan's (for a call after every request, once the engine's libraries are all loaded).
    Returns True when some runtime released them; False where no OpenMP runtime is loaded, none has the OpenMP 5.0
    routine, or each refused (inside a parallel region). Never raises.
    """
    global _pause_functions
    if rescan or _pause_functions is None:
        found = []
        for path in loaded_runtimes():
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            found.append((path, pause))
        _pause_functions = found
    released = False
    for path, pause in _pause_functions:
        rc = pause(OMP_PAUSE_SOFT)
        if rc != 0:
            logger.debug("omp_pause_resource_all in %s returned %d", path, rc)
        released |= rc == 0
    return released


__all__ = ["OMP_PAUSE_SOFT", "loaded_runtimes", "release_thread_pool"]
