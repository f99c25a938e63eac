"""One table of loom's C kernels and one `get_kernel(name)`.

A kernel is a `KernelSpec`: its name, its C sources, the ISAs it has variants for (best first) and the
binding that wraps the loaded library. An ISA is a set of /proc/cpuinfo flags it needs plus the compiler
flags that enable it; a source meant for several ISAs is compiled once per ISA (its `#if __AVX2__` blocks
pick the code), and `generic` is the portable build with no ISA flag (any CPU the compiler targets, ARM
included). `get_kernel` picks the best ISA this CPU has, builds it on first use (loom/kernels/build.py)
and caches the binding; the dispatch happens once, where a layer is set up, never per call.

Nothing is required: with `LOOM_CPU_KERNELS=0` (or false, no, off: loom/env.py), without a compiler, or on a CPU without any of the
kernel's ISAs, `get_kernel` returns None (logging why once) and callers keep their torch path.
`LOOM_CPU_ISA=avx2` (or `generic`) caps the choice, e.g. to run the AVX2 variants on an AVX-512 machine.

Adding a kernel is one entry in KERNELS.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loom.env import ISA_ORDER, cpu_isa_cap, env_flag
from loom.kernels import build
from loom.kernels.cpu import GemvBf16
from loom.kernels.cpu_generic import FusedOps, GemvF32, GemvFp8, GemvW16, PagedDecode, TokenBitmask
from loom.kernels.decode_step import DecodeStep
from loom.kernels.quant import QuantKernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Isa:
    """An instruction-set level: what the CPU must list and how to compile for it."""

    name: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags that must all be present
    cflags: tuple[str, ...]  # compiler flags that enable it (none: the source uses target attributes)


ISAS: dict[str, Isa] = {
    # Zen 4 / Ice Lake and later: 512-bit integer dot products (VPDPBUSD)
    "avx512_vnni": Isa("avx512_vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma",
                                                  "f16c"}),
                       ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                        "-mf16c")),
    # the bf16 sources carry their own target attributes
    "avx512_bf16": Isa("avx512_bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}), ()),
    # Haswell / Zen 1-3 and later
    "avx2": Isa("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "generic": Isa("generic", frozenset(), ()),
}


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One kernel library: sources compiled together, per ISA, wrapped by `binding(library, isa)`."""

    name: str
    sources: tuple[str, ...]  # files in loom/kernels/csrc
    isas: tuple[str, ...]  # ISAs it has code for, best first
    binding: Callable[[ctypes.CDLL, str], Any]  # (loaded library, ISA name) -> callable object


KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec("gemv_bf16", ("gemv_bf16.c",), ("avx512_bf16",), lambda lib, isa: GemvBf16(lib)),
        KernelSpec("paged_decode", ("paged_decode.c",), ("avx2", "generic"), PagedDecode),
        KernelSpec("fused_ops", ("fused_ops.c",), ("avx2", "generic"), FusedOps),
        KernelSpec("gemv_w16", ("gemv_w16.c",), ("avx2", "generic"), GemvW16),
        KernelSpec("gemv_f32", ("gemv_f32.c",), ("avx2", "generic"), GemvF32),
        KernelSpec("gemv_fp8", ("gemv_fp8.c",), ("avx512_vnni", "avx2", "generic"), GemvFp8),
        KernelSpec("token_bitmask", ("token_bitmask.c",), ("generic",), TokenBitmask),
        KernelSpec("qgemm", ("qgemm.c",), ("avx512_vnni", "avx2", "generic"), lambda lib, isa: QuantKernels(lib, isa)),
        # a whole decode step over packed (or bf16) weights: the four libraries above, one call per step
        KernelSpec("decode_step", ("decode_step.c", "qgemm.c", "gemv_w16.c", "gemv_fp8.c", "fused_ops.c",
                                    "paged_decode.c"),
                   ("avx512_vnni", "avx2", "generic"),
                   DecodeStep),
    )
}


def kernel_isas(name: str) -> list[str]:
    """The ISAs of kernel `name` this CPU can run, best first, after the LOOM_CPU_ISA cap.

    Raises:
        ValueError: unknown kernel name, or LOOM_CPU_ISA names no ISA.
    """
    spec = _spec(name)
    cap = cpu_isa_cap()
    allowed = ISA_ORDER if cap is None else ISA_ORDER[ISA_ORDER.index(cap):]
    flags = build.cpu_flags()
    return [isa for isa in spec.isas if isa in allowed and ISAS[isa].cpu_flags <= flags]


def get_kernel(name: str, isa: str | None = None) -> Any:
    """The binding of kernel `name` for `isa` (None: the best this CPU runs), or None when it cannot run here
    (switched off, no compiler, the CPU lacks the ISA); the reason is logged once.

    Raises:
        ValueError: unknown kernel or ISA name, LOOM_CPU_KERNELS is not an on/off value, or LOOM_CPU_ISA names no
            ISA.
    """
    spec = _spec(name)
    if isa is not None and isa not in spec.isas:
        raise ValueError(f"kernel {name!r} has no {isa!r} variant; it has {list(spec.isas)}")
    return _load(name, isa)


@functools.cache
def _load(name: str, isa: str | None) -> Any:
    if not env_flag("LOOM_CPU_KERNELS", True):
        return None
    spec = KERNELS[name]
    runnable = kernel_isas(name)
    chosen = isa if isa is not None else (runnable[0] if runnable else None)
    if chosen is None or chosen not in runnable:
        wanted = isa or " or ".join(spec.isas)
        capped = os.environ.get("LOOM_CPU_ISA")
        why = f"LOOM_CPU_ISA={capped} excludes" if capped else "this CPU does not run"
        logger.info("loom CPU kernel %s off: %s %s (torch paths run)", name, why, wanted)
        return None
    try:
        path = build.build_library(name, spec.sources, ISAS[chosen].cflags, tag=chosen)
        kernel = spec.binding(ctypes.CDLL(str(path)), chosen)
        logger.debug("loom CPU kernel %s: the %s build", name, chosen)
        return kernel
    except (OSError, RuntimeError) as exc:
        reason = str(exc)
        # one warning per distinct reason (a missing compiler stops every kernel the same way)
        level = logging.DEBUG if reason in _reported else logging.WARNING
        _reported.add(reason)
        logger.log(level, "loom CPU kernel %s off, torch paths run: %s", name, reason)
        return None


_reported: set[str] = set()  # failure reasons already logged at WARNING


def _spec(name: str) -> KernelSpec:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; known: {sorted(KERNELS)}")
    return KERNELS[name]


def fused_kernels_for(dtype: torch.dtype, device: torch.device | str, float32_kernels: bool) -> Any:
    """loom's fused elementwise ops (add+RMSNorm, SiLU*up, rotary) for a model of `dtype` on `device`, or None:
    the AVX2 / portable build (fused_ops, bfloat16 or float32), which the one-call decode step also runs, so
    the per-layer path (prefill, verify rows) rounds exactly like it; float32 only with `float32_kernels` (off
    on the oracle path, quantization "none", which keeps torch's ops)."""
    if torch.device(device).type != "cpu":
        return None
    if dtype == torch.bfloat16:
        return get_kernel("fused_ops")
    if dtype == torch.float32 and float32_kernels:
        return get_kernel("fused_ops")
    return None


def paged_decode_kernels() -> list[Any]:
    """The paged decode attention kernels that build here (each says what it `supports`): the AVX2 / portable
    one (bfloat16 and float32), which the one-call decode step also runs, so a verify or mixed step rounds like
    a pure decode step. (An AVX512-BF16 kernel was dropped on 2026-12-02: on a Sapphire Rapids-class CPU it was
    the slower, batch 16 x 1000 keys 0.75 vs 0.55 ms, and it rounded unlike the C step; benchmarks/NOTES.md.)"""
    return [k for k in (get_kernel("paged_decode"),) if k is not None]


def clear_kernel_cache() -> None:
    """Forget the loaded kernels, so the next call re-reads LOOM_CPU_KERNELS / LOOM_CPU_ISA (tests)."""
    _load.cache_clear()
