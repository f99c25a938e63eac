"""On/off switches read from the environment (LOOM_HUGE_PAGES, LOOM_CPU_KERNELS, LOOM_DECODE_STEP, ...), all parsed
by `env_flag`, so every switch takes the same values and a value it does not know is an error, not silently "on"."""

from __future__ import annotations

import os
from pathlib import Path

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off")


def cache_root() -> Path:
    """loom's cache directory: $LOOM_CACHE_DIR when set and non-empty, else ~/.cache/loom (not created)."""
    return Path(os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom")


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a torchrun launch (its rendezvous variables are set)."""
    return all(name in os.environ for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"))


def env_flag(name: str, default: bool) -> bool:
    """The on/off switch in environment variable `name`: 1, true, yes or on give True; 0, false, no or off give
    False (any case, surrounding whitespace ignored); unset, empty or only whitespace gives `default`.

    Raises:
        ValueError: any other value, naming the variable, its value and the accepted values.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ValueError(f"{name}={raw!r} is not an on/off value: use one of {', '.join(TRUE_VALUES)} (on) or "
                     f"{', '.join(FALSE_VALUES)} (off), any case, or leave it unset or empty for the default "
                     f"({'on' if default else 'off'})")


SWITCHES = {"LOOM_CPU_KERNELS": True, "LOOM_DECODE_STEP": True, "LOOM_SPARSE_DECODE_STEP": True,
            "LOOM_HUGE_PAGES": True, "LOOM_PIPELINE_PROFILE": False}  # every on/off switch loom reads, with its default
# the instruction-set levels of loom's C kernels, best first: LOOM_CPU_ISA caps the choice (loom/kernels/registry.py)
ISA_ORDER = ("avx512_vnni", "avx512_bf16", "avx2", "generic")


def cpu_isa_cap() -> str | None:
    """LOOM_CPU_ISA, lower-cased and stripped: the best ISA loom's kernels may use, or None when unset or empty.

    Raises:
        ValueError: a value that names no ISA.
    """
    cap = os.environ.get("LOOM_CPU_ISA", "").strip().lower()  # any case, as the on/off switches
    if not cap:
        return None
    if cap not in ISA_ORDER:
        raise ValueError(f"LOOM_CPU_ISA={cap!r} is not an ISA; choose from {list(ISA_ORDER)}")
    return cap


def check_switches() -> None:
    """Parse every switch in SWITCHES now (the CLI at start, EngineArgs before a model loads), so a bad value is an
    error even when the code that reads it would not run: LOOM_SPARSE_DECODE_STEP=maybe passed unless block-sparse
    decode was on.

    Raises:
        ValueError: a switch whose value is not an on/off value (env_flag's message), or a LOOM_CPU_ISA that names
            no ISA.
    """
    for name, default in SWITCHES.items():
        env_flag(name, default)
    cpu_isa_cap()
