"""Latency statistics, goodput SLOs and result files shared by the benchmarks.

Metric definitions (as in the common serving benchmarks):
  TTFT  time from sending a request to its first non-empty streamed chunk, seconds
  ITL   gaps between consecutive non-empty chunks of one request, seconds
  E2E   time from sending a request to its last byte, seconds
  TPOT  (E2E − TTFT) / (output_tokens − 1), seconds; undefined for one-token outputs
  goodput  completed requests per second that met every given SLO (Hong et al., DistServe, 2024)
"""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class LatencyStats:
    mean_ms: float  # arithmetic mean, milliseconds
    median_ms: float  # 50th percentile, milliseconds
    p99_ms: float  # 99th percentile (linear interpolation), milliseconds
    count: int  # samples the figures were computed from


def latency_stats(samples_s: list[float]) -> LatencyStats:
    """Mean, median and p99 of `samples_s` (seconds) in milliseconds; all NaN with count 0 when empty."""
    if not samples_s:
        nan = float("nan")
        return LatencyStats(nan, nan, nan, 0)
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    return LatencyStats(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)), len(samples_s))


def tpot_seconds(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """TPOT = (E2E − TTFT) / (output_tokens − 1) seconds, None when output_tokens < 2."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """Parse ["ttft:500", "tpot:50"] into {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out).

    Raises:
        ValueError: naming --goodput for an unknown metric, a missing colon or a non-positive value.
    """
    out: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes METRIC:MS with METRIC in {SLO_METRICS}, got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput value must be a number of milliseconds, got {spec!r}") from None
        if ms <= 0:
            raise ValueError(f"--goodput value must be > 0 ms, got {spec!r}")
        out[name] = ms / 1e3
    return out


def meets_slo(slo: dict[str, float], ttft_s: float, tpot_s: float | None, e2e_s: float) -> bool:
    """Whether one request met every SLO in `slo` (seconds). A missing TPOT (one token) meets a TPOT SLO."""
    measured = {"ttft": ttft_s, "tpot": tpot_s, "e2e": e2e_s}
    return all(measured[k] is None or measured[k] <= limit for k, limit in slo.items())


def machine_info() -> dict[str, str]:
    """CPU model name (lscpu), cores, Python/torch versions and load average (others sharing the cores)."""
    import os

    import torch

    cpu = platform.processor() or "unknown"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    load1, load5, _ = os.getloadavg()
    return {"cpu": cpu, "cores": str(os.cpu_count()), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": str(torch.get_num_threads()),
            "loadavg_1m_5m": f"{load1:.2f} {load5:.2f}"}


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write `payload` (dataclasses allowed at the top level) as indented JSON; creates parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in payload.items()}
    path.write_text(json.dumps(clean, indent=2, default=str))
    return path
